"""Setup self-check: llama.cpp loads the default model and decodes (in a child process, so a
SIGSEGV from a wrongly built wheel is reported instead of killing make)."""

import subprocess
import sys

CODE = """
from edgekv.engines.llamacpp import LlamaCppAdapter
a = LlamaCppAdapter(n_ctx=256)
logits = a.prefill(a.tokenize("Hello"), align=128)
assert logits.shape[0] > 1000
a.close()
"""

r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
if r.returncode != 0:
    sys.stderr.write(r.stderr[-2000:])
    print(f"engine self-check failed (exit {r.returncode})", file=sys.stderr)
    sys.exit(1)
print("engine self-check: llama.cpp decodes the default model")
