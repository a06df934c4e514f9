"""Bytes of KV a hit reads per cached token, with and without the sliding-window saving.

For each model: one cold request of ~1,100 tokens fills a fresh disk store; then lookups of
prefixes of P tokens (P = 256 .. 1024) read what a hit on P tokens reads. "stored" is every
layer group of those chunks (what the store keeps: a later prefix may end at any chunk);
"read" is what the chain walk returns (global layers for every chunk, local layers for the
chunks in the last window). Writes JSON to the path given (default
docs/bench/gemma/window-bytes.json).

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python scripts/window_bytes.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.engines.llamacpp import LlamaCppAdapter

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = (256, 512, 640, 768, 1024)


def kv_bytes(frags: object) -> int:
    return sum(f.keys.nbytes + f.values.nbytes for f in frags)  # type: ignore[attr-defined]


def measure(model: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="edgekv-window-") as tmp:
        cfg = CacheConfig(cache_dir=Path(tmp), reuse_granularity="chunk")
        a = LlamaCppAdapter(model, n_ctx=2048)
        kv = EdgeKV(a, open_store(cfg), cfg)
        try:
            text = (ROOT / "bench/edgekv_bench/texts.py").read_text()
            prompt = a.tokenize(text)[: max(PREFIXES) + 64]
            kv.generate(prompt, max_tokens=1)
            kv.store.clear_tier("ram")  # type: ignore[attr-defined]
            rows = []
            for p in PREFIXES:
                match = kv.lookup(prompt[: p + 1])
                stored = [f for k in kv.chunk_keys(prompt[:p])
                          for f in kv.reader.read(k, 0.0, []).fragments]  # type: ignore[union-attr]
                rows.append({
                    "prefix_tokens": match.n_tokens,
                    "kv_bytes_stored": kv_bytes(stored),
                    "kv_bytes_read": kv_bytes(match.fragments),
                    "stored_per_token": kv_bytes(stored) / p,
                    "read_per_token": round(kv_bytes(match.fragments) / match.n_tokens, 1),
                    "fragments_read": len(match.fragments),
                })
            fp = a.fingerprint
            return {"model": a.model_path.name, "architecture": fp.architecture,
                    "n_layer": fp.n_layer, "local_layers": list(a.window.swa_layers),
                    "window": a.window.n_swa, "kv_bytes_per_token_all_layers":
                    fp.kv_bytes_per_token, "prefixes": rows}
        finally:
            kv.close()
            a.close()


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/bench/gemma/window-bytes.json"
    res = {"bench": "window-bytes", "models": [measure("gemma3"), measure("smollm2")]}
    out.write_text(json.dumps(res, indent=1) + "\n")
    for m in res["models"]:
        print(m["model"])  # type: ignore[index]
        for r in m["prefixes"]:  # type: ignore[index]
            print(f"  P={r['prefix_tokens']:5d}  stored {r['stored_per_token']:8.0f} B/token  "
                  f"read {r['read_per_token']:8.0f} B/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
