"""Unpack the native libraries (llama_cpp/lib/*) of the one llama-cpp-python wheel in WHEEL_DIR
into LIB_DIR, flat, for LLAMA_CPP_LIB_PATH: python scripts/unpack_lib.py WHEEL_DIR LIB_DIR.
(The libraries find each other through their $ORIGIN run path, so the folder is self-contained.)
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def main() -> int:
    wheel_dir, lib_dir = Path(sys.argv[1]), Path(sys.argv[2])
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    if len(wheels) != 1:
        print(f"unpack_lib: expected one llama_cpp_python wheel in {wheel_dir}, "
              f"found {len(wheels)}", file=sys.stderr)
        return 1
    lib_dir.mkdir(parents=True, exist_ok=True)
    n = 0
    with zipfile.ZipFile(wheels[0]) as z:
        for info in z.infolist():
            name = info.filename
            if name.startswith("llama_cpp/lib/") and not name.endswith("/"):
                (lib_dir / Path(name).name).write_bytes(z.read(info))
                n += 1
    if not (lib_dir / "libllama.so").exists():
        print(f"unpack_lib: no libllama.so in {wheels[0].name}", file=sys.stderr)
        return 1
    print(f"unpack_lib: {n} libraries from {wheels[0].name} -> {lib_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
