"""A small tool-using agent on LangChain's chat-model interface: a plain loop, or LangGraph's
ReAct agent (--langgraph).

    python examples/langchain_agent.py                       # the embedded default model
    python examples/langchain_agent.py --model /models/qwen3.8-27b-q4_k_m.gguf --thinking
    python examples/langchain_agent.py --model /models/qwen3.8-27b-q4_k_m.gguf --langgraph

The model sees the tools in its chat template; each tool call it writes (Qwen3.5's
`<tool_call><function=...>` form or the JSON form of older Qwens) is run and its result goes back
as a ToolMessage, until it answers without calling a tool (or --max-steps is reached).
The embedded default model has random weights: it answers gibberish and rarely calls a tool, but
every step below runs for real.
"""

from __future__ import annotations

import argparse
import ast
import operator

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from openjet_plugin.adapters.langchain import ChatOpenJet

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / ** are allowed")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '(3 + 4) * 12'."""
    return str(_eval(ast.parse(expression, mode="eval").body))


@tool
def word_count(text: str) -> int:
    """Count the words in a text."""
    return len(text.split())


TOOLS = {t.name: t for t in (calculator, word_count)}


def run_agent(chat: ChatOpenJet, question: str, max_steps: int) -> str:
    model = chat.bind_tools(list(TOOLS.values()))
    messages = [SystemMessage("You are a careful assistant. Use the tools for arithmetic."),
                HumanMessage(question)]
    for step in range(1, max_steps + 1):
        reply = model.invoke(messages)
        messages.append(reply)
        usage = reply.usage_metadata
        print(f"step {step}: {usage['input_tokens']} prompt tokens, {usage['output_tokens']} generated, "
              f"{len(reply.tool_calls)} tool calls, {len(reply.invalid_tool_calls)} malformed "
              f"[{reply.response_metadata['backend']}, finish: {reply.response_metadata['finish_reason']}]")
        if reasoning := reply.additional_kwargs.get("reasoning_content"):
            print(f"  thinking: {reasoning[:200]!r}")
        for bad in reply.invalid_tool_calls:
            messages.append(ToolMessage(f"Error: malformed tool call ({bad['error']})",
                                        tool_call_id=bad["id"] or "invalid", status="error"))
        if not reply.tool_calls and not reply.invalid_tool_calls:
            return reply.text
        for call in reply.tool_calls:
            fn = TOOLS.get(call["name"])
            try:
                result = fn.invoke(call["args"]) if fn else f"Error: no tool named {call['name']!r}"
            except Exception as exc:  # noqa: BLE001 - a tool error goes back to the model
                result = f"Error: {exc}"
            print(f"  tool {call['name']}({call['args']}) -> {result!r}")
            messages.append(ToolMessage(str(result), tool_call_id=call["id"]))
    return messages[-1].text if hasattr(messages[-1], "text") else ""


def run_langgraph(chat: ChatOpenJet, question: str, max_steps: int) -> str:
    """The same agent as LangGraph's prebuilt ReAct graph: model -> tools -> model ... -> answer."""
    import warnings

    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # LangGraph 1.0 points to langchain.agents.create_agent
        agent = create_react_agent(chat, list(TOOLS.values()),
                                   prompt="You are a careful assistant. Use the tools for arithmetic.")
    # each step is a model call or a tool call: two graph steps per round trip, one for the answer
    state = agent.invoke({"messages": [HumanMessage(question)]}, {"recursion_limit": 2 * max_steps + 1})
    for m in state["messages"][1:]:
        calls = [f"{c['name']}({c['args']})" for c in getattr(m, "tool_calls", [])]
        print(f"{type(m).__name__}: {m.text[:120]!r}" + (f" calls {', '.join(calls)}" if calls else ""))
    return state["messages"][-1].text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded model)")
    ap.add_argument("--question", default="What is (3 + 4) * 12? Use the calculator.")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--thinking", action="store_true", help="let the model think first")
    ap.add_argument("--langgraph", action="store_true", help="run LangGraph's ReAct agent instead of the loop")
    args = ap.parse_args()

    chat = ChatOpenJet(model=args.model, temperature=0, max_tokens=args.max_tokens,
                       enable_thinking=args.thinking)
    answer = (run_langgraph if args.langgraph else run_agent)(chat, args.question, args.max_steps)
    print(f"answer: {answer!r}")


if __name__ == "__main__":
    main()
