"""What `make run` shows: a real model answers real prompts cold and warm, same output."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from edgekv.chat import ChatTokenizer
from edgekv.config import CacheConfig, default_cache_dir

from .markdown import table
from .texts import MANUAL, QUESTIONS, SYSTEM_PROMPT

__all__ = ["run_demo"]


def run_demo(*, model: str | None = None, n_ctx: int = 2048, cache_dir: str | None = None,
             questions: int = 3, max_tokens: int = 32) -> int:
    from edgekv import open_llamacpp

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    demo_dir = root / "demo"  # the demo's own store, emptied so the first request is cold
    shutil.rmtree(demo_dir, ignore_errors=True)
    kv = open_llamacpp(model, CacheConfig(cache_dir=demo_dir), n_ctx=n_ctx)
    try:
        chat = ChatTokenizer(kv.adapter)
        system = SYSTEM_PROMPT + "\n\n" + MANUAL

        def prompt(q: str) -> list[int]:
            return chat.tokens([{"role": "system", "content": system},
                                {"role": "user", "content": q}])

        print(f"model: {kv.adapter.model_path.name}; context: the assistant's system prompt + "  # type: ignore[attr-defined]
              f"a {len(prompt(''))}-token manual\n", flush=True)
        first = kv.generate(prompt(QUESTIONS[0]), max_tokens=max_tokens)
        print(f"first request (cache empty): TTFT {first.ttft_s * 1000:.0f} ms, stored "
              f"{first.stored_fragments} fragments ({first.computed_tokens} tokens computed)\n")
        rows, same_all = [], True
        for q in QUESTIONS[1 : 1 + questions]:
            cold = kv.generate(prompt(q), max_tokens=max_tokens, use_cache=False)
            warm = kv.generate(prompt(q), max_tokens=max_tokens)
            same = (cold.tokens == warm.tokens
                    and bool((cold.first_logits == warm.first_logits).all()))
            same_all &= same
            rows.append([q, f"{cold.ttft_s * 1000:.0f}", f"{warm.ttft_s * 1000:.0f}",
                         f"{cold.ttft_s / warm.ttft_s:.1f}x",
                         f"{warm.cached_tokens}/{warm.prompt_tokens}", "yes" if same else "NO"])
            print(f"Q: {q}\nA: {warm.text.strip()}\n", flush=True)
        print(table(["question", "cold TTFT ms", "warm TTFT ms", "speedup", "reused tokens",
                     "identical output"], rows))
        print("\nwarm = the shared prefix's KV injected from the fragment cache, only the new "
              "tokens prefilled; identical = same greedy tokens and bit-identical logits.")
        return 0 if same_all else 1
    finally:
        kv.store.close()
        kv.adapter.close()


if __name__ == "__main__":
    sys.exit(run_demo())
