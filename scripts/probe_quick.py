"""The batch-invariance probe on one model and build, printed in one line (for comparing
builds by hand; `edgekv probe` is the full command with a prefill timing).

Usage: [LLAMA_CPP_LIB_PATH=DIR] [GGML_CPU_BATCH_INVARIANT=1] python scripts/probe_quick.py
           fa|nofa [MODEL|-] [LONG_TOKENS (0 = skip the long prompt)]
"""

from __future__ import annotations

import sys


def main() -> int:
    from edgekv.engines.llamacpp import LlamaCppAdapter
    from edgekv.engines.probe import probe_batch_invariance

    fa = sys.argv[1] == "fa"
    model = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    long_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    kwargs = {"flash_attn": True} if fa else {}
    a = LlamaCppAdapter(model, n_ctx=2048, n_threads=2, **kwargs)
    try:
        r = probe_batch_invariance(a, long_tokens=long_tokens)
    finally:
        a.close()
    ok = sum(d == 0.0 and s for _, d, s in r.results)
    print(f"{ok}/{len(r.results)} failed: {r.failed} notes: {r.notes} {r.seconds:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
