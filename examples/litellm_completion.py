"""LiteLLM with the openjet provider: `litellm.completion(model="openjet/...")`, plain and streamed.

    python examples/litellm_completion.py                     # the embedded default model
    python examples/litellm_completion.py --model /models/qwen3.8-27b-q4_k_m.gguf

The model name is "openjet/" followed by a GGUF path or "default" (the embedded model). The first
call loads the model; later calls reuse it.
"""

from __future__ import annotations

import argparse
import asyncio

from openjet_plugin.adapters.litellm import register

import litellm  # noqa: E402  (after the adapter, which keeps LiteLLM from fetching a cost map)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="GGUF path or 'default'")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    register()
    model = f"openjet/{args.model}"
    messages = [{"role": "system", "content": "You are concise."},
                {"role": "user", "content": "Name three prime numbers."}]

    r = litellm.completion(model=model, messages=messages, temperature=0, max_tokens=args.max_tokens)
    print(f"reply: {r.choices[0].message.content!r}")
    print(f"finish: {r.choices[0].finish_reason}; usage: prompt {r.usage.prompt_tokens}, "
          f"completion {r.usage.completion_tokens}, total {r.usage.total_tokens}")

    pieces = []
    for chunk in litellm.completion(model=model, messages=messages, temperature=0, max_tokens=args.max_tokens,
                                    stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None):
            print(f"streamed usage: completion {chunk.usage.completion_tokens}")
    print(f"streamed {len(pieces)} pieces; same text as the plain call: "
          f"{''.join(pieces) == r.choices[0].message.content}")

    async def ask_async() -> str:
        resp = await litellm.acompletion(model=model, messages=messages, temperature=0, max_tokens=8)
        return resp.choices[0].message.content

    print(f"async reply: {asyncio.run(ask_async())!r}")


if __name__ == "__main__":
    main()
