"""The llama-cpp-python drop-in: keep the code, add one line before it imports llama_cpp.

    python examples/llama_cpp_dropin.py                       # the embedded default model
    python examples/llama_cpp_dropin.py --model /models/qwen3.8-27b-q4_k_m.gguf

    import openjet_plugin.adapters.llama_cpp as dropin; dropin.install()   # the one line
    from llama_cpp import Llama, LlamaGrammar       # now openjet's Llama, llama-cpp-python's grammar
    # (or, without install(): from openjet_plugin.adapters.llama_cpp import Llama)
"""

from __future__ import annotations

import argparse

import openjet_plugin
import openjet_plugin.adapters.llama_cpp as dropin

dropin.install()

from llama_cpp import Llama, LlamaGrammar  # noqa: E402  (after install(): the drop-in's Llama)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded model)")
    args = ap.parse_args()
    path = args.model or str(openjet_plugin.default_model_path())

    llm = Llama(model_path=path, n_ctx=1024, verbose=False)
    print(f"model: {llm.metadata.get('general.name')} ({llm.n_vocab()} tokens, n_ctx {llm.n_ctx()}, "
          f"backend {llm.backend_name})")

    out = llm("Q: Name the planets in the solar system. A:", max_tokens=24, stop=["Q:", "\n\n"], temperature=0)
    print(f"completion: {out['choices'][0]['text']!r} [{out['choices'][0]['finish_reason']}] "
          f"usage {out['usage']}")

    streamed = "".join(c["choices"][0]["text"] for c in
                       llm("Q: Name the planets in the solar system. A:", max_tokens=24, stop=["Q:", "\n\n"],
                           temperature=0, stream=True))
    print(f"stream equals completion: {streamed == out['choices'][0]['text']}")

    chat = llm.create_chat_completion(
        messages=[{"role": "system", "content": "You are concise."},
                  {"role": "user", "content": "Say hello."}],
        max_tokens=24, temperature=0)
    print(f"chat: {chat['choices'][0]['message']['content']!r} usage {chat['usage']}")

    yes_no = LlamaGrammar.from_string('root ::= "yes" | "no"')
    answer = llm("Q: Is the sea salty? A: ", grammar=yes_no, max_tokens=4, temperature=0)["choices"][0]["text"]
    print(f"grammar-constrained answer: {answer!r}")

    tokens = llm.tokenize(b"Hello, world!")
    print(f"tokens: {tokens} -> {llm.detokenize(tokens)!r}")
    llm.close()


if __name__ == "__main__":
    main()
