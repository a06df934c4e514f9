"""A LangChain tool-calling agent against `edgekv serve`: two tools, five questions, end to end.

    .venv/bin/python scripts/agent_demo.py [--model GGUF] [--out docs/bench/agent]

Starts `edgekv serve` (a fresh cache directory; whole-chunk reuse, so no batch-invariance probe
runs at start), binds a calculator and a capital-city lookup to `ChatOpenAI`, and runs each
question as an agent loop: ask, execute every tool call the model makes, send the results back
as `ToolMessage`s, until the model answers in text (at most `--steps` rounds). Two policies,
each over all five questions:

- `auto`: `tool_choice="auto"` every round (the model decides whether to call a tool);
- `forced-first`: `tool_choice="any"` (OpenAI's "required") in the first round, so the first
  answer is grammar-constrained to a call, then `auto`.

Everything the model did is recorded, not filtered: the calls the server returned, the calls
LangChain parsed (and the ones it could not), the tool results, the final answer, and whether
it holds the expected answer. Written to OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import operator
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from serve_demo import start, wait_healthy  # noqa: E402

from edgekv.serve.runner import stop_process  # noqa: E402

CAPITALS = {"france": "Paris", "japan": "Tokyo", "kenya": "Nairobi", "peru": "Lima",
            "canada": "Ottawa"}
QUESTIONS = [  # (question, the text a right answer contains)
    ("What is 17 times 23?", "391"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is 1024 divided by 8?", "128"),
    ("What is the capital of Kenya?", "Nairobi"),
    ("What is 250 plus 475?", "725"),
]
SYSTEM = ("You are a careful assistant. Use the calculator for arithmetic and capital_city "
          "for capitals, then answer in one short sentence.")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.Pow: operator.pow}


def calculate(expression: str) -> str:
    """Arithmetic on numbers only (+ - * / **), by walking the parsed expression."""
    def ev(n: ast.AST) -> float:
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.operand))
        raise ValueError(f"not arithmetic: {ast.dump(n)[:60]}")
    try:
        v = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def build_tools() -> dict[str, Any]:
    from langchain_core.tools import tool

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as '12 * (3 + 4)'."""
        return calculate(expression)

    @tool
    def capital_city(country: str) -> str:
        """The capital city of a country."""
        return CAPITALS.get(country.strip().lower(), f"unknown country: {country}")

    return {"calculator": calculator, "capital_city": capital_city}


def run_question(llm: Any, tools: dict[str, Any], question: str, expected: str, policy: str,
                 steps: int) -> dict[str, Any]:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    msgs: list[Any] = [SystemMessage(SYSTEM), HumanMessage(question)]
    rounds = []
    final = ""
    for i in range(steps):
        choice = "any" if policy == "forced-first" and i == 0 else "auto"
        ai = llm.bind_tools(list(tools.values()), tool_choice=choice).invoke(msgs)
        # every call the server returned lands in one of the two lists: parsed or not
        returned = len(ai.tool_calls) + len(ai.invalid_tool_calls)
        rnd: dict[str, Any] = {"tool_choice": choice, "returned_calls": returned,
                               "parsed_calls": [{"name": c["name"], "args": c["args"]}
                                                for c in ai.tool_calls],
                               "invalid_calls": len(ai.invalid_tool_calls),
                               "finish_reason": ai.response_metadata.get("finish_reason"),
                               "content": ai.content}
        msgs.append(ai)
        if not ai.tool_calls:
            rounds.append(rnd)
            final = str(ai.content)
            break
        results = []
        for c in ai.tool_calls:
            t = tools.get(c["name"])
            out = t.invoke(c["args"]) if t is not None else f"no tool {c['name']}"
            results.append(str(out))
            msgs.append(ToolMessage(str(out), tool_call_id=c["id"]))
        rnd["tool_results"] = results
        rounds.append(rnd)
    else:
        final = ""  # still calling tools after `steps` rounds: no answer
    used = [c for r in rounds for c in r["parsed_calls"]]
    return {"question": question, "expected": expected, "policy": policy, "rounds": rounds,
            "final_answer": final, "answered": bool(final),
            "right": expected.lower() in final.lower(),
            "tool_result_right": any(expected.lower() in x.lower()
                                     for r in rounds for x in r.get("tool_results", [])),
            "calls": len(used)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rounds = [r for row in rows for r in row["rounds"]]
    return {"questions": len(rows),
            "calls_returned": sum(r["returned_calls"] for r in rounds),
            "calls_parsed": sum(len(r["parsed_calls"]) for r in rounds),
            "calls_invalid": sum(r["invalid_calls"] for r in rounds),
            "questions_with_a_call": sum(1 for row in rows if row["calls"]),
            "tool_result_right": sum(1 for row in rows if row["tool_result_right"]),
            "answered": sum(1 for row in rows if row["answered"]),
            # the model repeating the results turn's JSON instead of answering in words
            "answer_echoes_tool_results": sum(1 for row in rows if row["final_answer"]
                                              .lstrip().startswith('{"tool_results"')),
            "answers_right": sum(1 for row in rows if row["right"])}


def markdown(res: dict[str, Any]) -> str:
    out = ["# LangChain agent loop against `edgekv serve`", "",
           f"Model `{res['model']}`, langchain-openai {res['langchain_openai']}, "
           f"temperature {res['temperature']}, at most {res['steps']} rounds per question. "
           "Produced by `scripts/agent_demo.py`; every question is shown, none left out.", "",
           "| policy | calls returned | parsed by LangChain | invalid | questions with a call "
           "| tool result right | answered | answer echoes the results JSON | answers right |",
           "|---|---|---|---|---|---|---|---|---|"]
    for p, s in res["summary"].items():
        out.append(f"| {p} | {s['calls_returned']} | {s['calls_parsed']} | {s['calls_invalid']}"
                   f" | {s['questions_with_a_call']}/{s['questions']} | {s['tool_result_right']}"
                   f" | {s['answered']} | {s['answer_echoes_tool_results']} | "
                   f"{s['answers_right']}/{s['questions']} |")
    out += ["", "An answer is right when it holds the expected text (a number, a city). "
            "'calls returned': the calls in the server's responses (LangChain puts each in "
            "`tool_calls` or, if it cannot parse it, `invalid_tool_calls`)."]
    out += ["", "| policy | question | calls (name: args -> result) | final answer | right |",
            "|---|---|---|---|---|"]
    for row in res["runs"]:
        calls = "; ".join(f"{c['name']}: {json.dumps(c['args'])} -> {x}"
                          for r in row["rounds"]
                          for c, x in zip(r["parsed_calls"], r.get("tool_results", [])))
        ans = row["final_answer"].replace("\n", " ").replace("|", "\\|")[:120]
        out.append(f"| {row['policy']} | {row['question']} | {calls or '(none)'} | "
                   f"{ans or '(none)'} | {'yes' if row['right'] else 'no'} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/bench/agent")
    ap.add_argument("--steps", type=int, default=3, help="rounds per question (default 3)")
    args = ap.parse_args()
    try:
        from langchain_openai import ChatOpenAI
    except ImportError:
        raise SystemExit("the demo needs LangChain: pip install -e '.[test,serve]'") from None
    os.environ["EDGEKV_REUSE_GRANULARITY"] = "chunk"  # no probe at start (see the doc)
    with tempfile.TemporaryDirectory(prefix="edgekv-agent-") as tmp:
        proc, url = start(Path(tmp), args.model)
        try:
            wait_healthy(proc, url)
            llm = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="default",
                             temperature=0, max_tokens=96, max_retries=0, timeout=600)
            tools = build_tools()
            runs = []
            t0 = time.monotonic()
            for policy in ("auto", "forced-first"):
                for q, want in QUESTIONS:
                    runs.append(run_question(llm, tools, q, want, policy, args.steps))
                    print(f"{policy:12} {q:34} -> {runs[-1]['final_answer'][:60]!r} "
                          f"({'right' if runs[-1]['right'] else 'wrong'})", flush=True)
            wall = time.monotonic() - t0
        finally:
            stop_process(proc)
    res = {"model": Path(args.model).stem if args.model else "SmolLM2-135M-Instruct.Q4_1",
           "langchain_openai": importlib.metadata.version("langchain-openai"),
           "temperature": 0, "steps": args.steps, "wall_s": round(wall, 1),
           "summary": {p: summarize([r for r in runs if r["policy"] == p])
                       for p in ("auto", "forced-first")},
           "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
