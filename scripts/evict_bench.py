"""How long one leaf-first eviction takes as the prefix index grows (issue 22).

    .venv/bin/python scripts/evict_bench.py [--chunks 100000] [--json docs/bench/evict.json]

A RAM tier of `--chunks` small chunks (chains of 100 chunks of 64 tokens; the KV is tiny:
the index does not read it), the prefix index over it, then 200 calls of `evict(1)` (one
leaf each), timed; the survivors' digest makes two runs comparable (the same order frees the
same chunks). Run it on two commits to compare implementations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from edgekv.core.prefix_index import PrefixIndex  # noqa: E402
from edgekv.fragment import KVFragment  # noqa: E402
from edgekv.keys import next_key  # noqa: E402
from edgekv.store.memory import MemoryStore  # noqa: E402


def run(chunks: int, calls: int = 200, per_chain: int = 100) -> dict[str, object]:
    fp, span = "f" * 64, 64
    store = MemoryStore(1 << 40)
    rng = np.random.default_rng(0)
    for _ in range(0, chunks, per_chain):
        parent = ""
        for i in range(per_chain):
            ids = rng.integers(0, 30000, span, dtype=np.int32)
            key = next_key(parent, fp, ids)
            kv = np.zeros((1, span, 2), np.float16)
            store.put(key, KVFragment(
                model_fingerprint=fp, chain_key=key, parent_key=parent, token_start=i * span,
                token_end=(i + 1) * span, layer_start=0, layer_end=1, layer_stride=1,
                n_layer_model=1, token_ids=ids, keys=kv, values=kv))
            parent = key
    index = PrefixIndex(store, fp, lambda k: [(k,)])
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        index.evict(1)
        times.append(time.perf_counter() - t)
    survivors = hashlib.sha256("".join(sorted(store.keys())).encode()).hexdigest()[:16]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"chunks": chunks, "evict_calls": calls,
            "evict_ms_mean": round(1000 * sum(times) / len(times), 4),
            "evict_ms_max": round(1000 * max(times), 4), "survivors_sha": survivors,
            "commit": commit}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--json")
    args = ap.parse_args()
    res = run(args.chunks)
    print(json.dumps(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
