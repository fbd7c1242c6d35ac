"""The llama-cpp-python drop-in: change one import, keep the code.

    python examples/llama_cpp_dropin.py                       # the embedded default model
    python examples/llama_cpp_dropin.py --model /models/qwen3.8-27b-q4_k_m.gguf

    from llama_cpp import Llama                      # before
    from openjet_plugin.adapters.llama_cpp import Llama   # after: same calls, same response dicts
"""

from __future__ import annotations

import argparse

import openjet_plugin
from openjet_plugin.adapters.llama_cpp import Llama


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

    tokens = llm.tokenize(b"Hello, world!")
    print(f"tokens: {tokens} -> {llm.detokenize(tokens)!r}")
    llm.close()


if __name__ == "__main__":
    main()
