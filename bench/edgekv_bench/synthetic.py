"""Models made for measuring, never for answers: GGUFs of real architectures with random
weights, and the packaged models in other weight types (issue 33).

- **Synthetic models** (`synthetic-<shape>-<type>`, for example `synthetic-llama3.2-1b-q4_k_m`):
  a real architecture at a published shape, with random weights and the tokenizer of a packaged
  model (SmolLM2's for the llama shapes, Gemma 3's for the gemma one). They measure speed, KV
  size and exactness at sizes the packaged 135M and 270M models do not have. Their answers are
  noise: every row and file that holds one says `synthetic`, and the GGUF itself carries
  `general.name = "synthetic ..."` and `edgekv.synthetic = <shape>`.
  - `smollm2-2l`, `gemma3-2l`: the CI stand-ins. The packaged models' own architecture,
    shape, tokenizer and tensor set with 2 layers (Gemma's with one sliding-window layer and one
    global one), so that the ARM check (scripts/arm_check.sh) runs every weight type's kernels
    under qemu within CI's time: the same tensor shapes, so llama-quantize picks the same
    per-tensor types (SmolLM2's 576 columns are not a multiple of 256, so most of its K-quant
    tensors fall back to Q5_0/Q5_1/Q8_0, as they do in the packaged model).
  - the ladder (`smollm2-360m`, `llama3.2-1b`, `smollm2-1.7b`): the published shapes of
    SmolLM2 360M, Llama 3.2 1B (with SmolLM2's 49,152-token vocabulary: 1.0B parameters, not
    1.24B) and SmolLM2 1.7B.
  Written with the `gguf` package as F16 once (`<cache dir>/models/synthetic/`, never
  committed), then quantized.
- **Requantized packaged models** (`smollm2-<type>`): SmolLM2 from its packaged Q4_1
  (`--allow-requantize`: no F16 original ships), the weight types edge users run.

Quantization is llama.cpp's own (`llama_model_quantize`, the function `llama-quantize` calls),
through the .venv's llama-cpp-python, or a `llama-quantize` binary where one is given.

Usage: python -m edgekv_bench.synthetic NAME... [--cache-dir DIR]  (prints each file's path)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edgekv.errors import EdgeKVError

__all__ = ["CI_STANDINS", "LADDER", "SHAPES", "WEIGHT_TYPES", "Shape", "ensure_model",
           "is_synthetic", "model_params", "quantize", "tensor_set", "write_synthetic"]

# weight type (the name's suffix) -> llama_ftype (llama.h: LLAMA_FTYPE_MOSTLY_*)
WEIGHT_TYPES = {"f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q3_k_m": 12, "q4_k_m": 15,
                "q5_k_m": 17, "q6_k": 18, "iq4_xs": 30}


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    template: str  # the packaged model whose architecture, tokenizer and tensor set it takes
    layers: int
    published: str  # what the shape follows
    # llama shapes: n_embd, n_ff, n_head, n_head_kv (head size 64 as SmolLM2's); None: the
    # template's own widths
    widths: tuple[int, int, int, int] | None = None
    overrides: dict[str, int | float] = field(default_factory=dict)  # <arch>.<key> -> value


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("smollm2-2l", "smollm2", 2, "SmolLM2 135M with 2 of its 30 layers (CI stand-in)"),
    Shape("gemma3-2l", "gemma3", 2, "Gemma 3 270M with 2 of its 18 layers, one sliding-window "
          "and one global (CI stand-in)", overrides={"attention.sliding_window_pattern": 2}),
    Shape("smollm2-360m", "smollm2", 32, "SmolLM2 360M", (960, 2560, 15, 5)),
    Shape("llama3.2-1b", "smollm2", 16, "Llama 3.2 1B (SmolLM2's vocabulary)",
          (2048, 8192, 32, 8), {"rope.freq_base": 500000.0}),
    Shape("smollm2-1.7b", "smollm2", 24, "SmolLM2 1.7B", (2048, 8192, 32, 32),
          {"rope.freq_base": 130000.0}),
)}
CI_STANDINS = ("synthetic-smollm2-2l-q4_0", "synthetic-smollm2-2l-q4_1",
               "synthetic-smollm2-2l-q8_0", "synthetic-smollm2-2l-q4_k_m",
               "synthetic-smollm2-2l-q5_k_m", "synthetic-smollm2-2l-q6_k",
               "synthetic-gemma3-2l-q4_k_m")
LADDER = ("synthetic-smollm2-360m-q4_k_m", "synthetic-llama3.2-1b-q4_k_m",
          "synthetic-smollm2-1.7b-q4_k_m")


def parse_name(name: str) -> tuple[str, str]:
    """`synthetic-<shape>-<type>` or `smollm2-<type>` -> (shape or "smollm2", weight type)."""
    base, _, wtype = name.rpartition("-")
    if wtype not in WEIGHT_TYPES:
        raise EdgeKVError(f"{name!r}: the weight type {wtype!r} is not one of "
                          f"{', '.join(WEIGHT_TYPES)}")
    if base == "smollm2":
        return base, wtype
    shape = base.removeprefix("synthetic-")
    if not base.startswith("synthetic-") or shape not in SHAPES:
        raise EdgeKVError(f"{name!r}: not smollm2-<type> or synthetic-<shape>-<type> with a "
                          f"shape of {', '.join(SHAPES)}")
    return shape, wtype


def is_synthetic(name: str) -> bool:
    return name.startswith("synthetic-")


def ensure_model(name: str, cache_dir: Path, llama_quantize: Path | None = None,
                 progress: Callable[[str], None] | None = None) -> Path:
    """The GGUF for `name` in `<cache dir>/models/`, made the first time."""
    from edgekv.engines.models import resolve_model

    shape, wtype = parse_name(name)
    models = Path(cache_dir) / "models"
    if shape == "smollm2":
        source = resolve_model("smollm2", cache_dir)
        if wtype == "q4_1":
            return source
        dst = models / f"{source.stem.rsplit('.', 1)[0]}.{wtype.upper()}-from-Q4_1.gguf"
        if not dst.exists():
            quantize(source, dst, wtype, requantize=True, llama_quantize=llama_quantize)
        return dst
    base = models / "synthetic" / f"{shape}.F16.gguf"
    if not base.exists():
        if progress:
            progress(f"writing {base} (random weights)")
        write_synthetic(SHAPES[shape], base, resolve_model(SHAPES[shape].template, cache_dir))
    if wtype == "f16":
        return base
    dst = base.with_name(f"{shape}.{wtype.upper()}.gguf")
    if not dst.exists():
        if progress:
            progress(f"quantizing {dst}")
        quantize(base, dst, wtype, llama_quantize=llama_quantize)
    return dst


def _tmp_path(dst: Path) -> Path:
    """Where `dst` is written before its atomic rename: one per process, so two processes
    that make the same model at once (CI's ARM check runs beside the tests) never write into
    each other's file; both renames leave the same bytes."""
    return dst.with_suffix(f".{os.getpid()}.tmp")


def quantize(src: Path, dst: Path, wtype: str, *, requantize: bool = False,
             llama_quantize: Path | None = None) -> None:
    """llama.cpp's quantization of `src` to `wtype`, written to `dst` atomically."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(dst)
    if llama_quantize is not None:
        if not llama_quantize.is_file():
            raise EdgeKVError(f"{llama_quantize} is missing: run `make llama-server` "
                              "(it builds llama-quantize), or pass no --llama-quantize to use "
                              "llama-cpp-python's llama_model_quantize")
        res = subprocess.run([str(llama_quantize), *(["--allow-requantize"] if requantize else []),
                              str(src), str(tmp), wtype.upper()], capture_output=True, text=True)
        if res.returncode != 0:
            raise EdgeKVError(f"llama-quantize {wtype} failed: {res.stderr[-400:]}")
    else:
        # in a child process: the parent may have loaded another build's library
        code = ("import ctypes, sys, llama_cpp as l\n"
                "p = l.llama_model_quantize_default_params()\n"
                "p.ftype = int(sys.argv[3]); p.allow_requantize = sys.argv[4] == '1'\n"
                "p.nthread = 0\n"
                "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
                "ctypes.byref(p)))\n")
        res = subprocess.run([sys.executable, "-c", code, str(src), str(tmp),
                              str(WEIGHT_TYPES[wtype]), "1" if requantize else "0"],
                             capture_output=True, text=True)
        if res.returncode != 0 or not tmp.exists():
            raise EdgeKVError(f"llama_model_quantize {src.name} -> {wtype} failed "
                              f"(exit {res.returncode}): {res.stderr[-400:]}")
    os.replace(tmp, dst)


def _dims(shape: Shape, arch_kv: dict[str, int]) -> dict[int, int]:
    """template width -> this shape's width (llama shapes from SmolLM2's template)."""
    if shape.widths is None:
        return {}
    n_embd, n_ff, _n_head, n_kv = shape.widths
    head = arch_kv["embedding_length"] // arch_kv["attention.head_count"]
    return {arch_kv["embedding_length"]: n_embd, arch_kv["feed_forward_length"]: n_ff,
            arch_kv["attention.head_count_kv"] * head: n_kv * head}


def tensor_set(template: Sequence[tuple[str, list[int]]], layers: int,
               dims: dict[int, int]) -> list[tuple[str, list[int]]]:
    """The tensors of a model of `layers` layers from its template's (name, ggml shape) list:
    the template's tensors outside the blocks, and its first block's tensors for every one of
    the `layers` blocks (a shape may have more layers than its template: SmolLM2 360M's 32
    against 135M's 30), each width mapped by `dims`; shapes in numpy order (rows first)."""
    def np_shape(ne: list[int]) -> list[int]:
        return list(reversed([dims.get(d, d) for d in ne]))

    block = [(name.split(".", 2)[2], ne) for name, ne in template if name.startswith("blk.0.")]
    out: list[tuple[str, list[int]]] = []
    for name, ne in template:
        if not name.startswith("blk."):
            out.append((name, np_shape(ne)))
        elif name.startswith("blk.0.") and name.split(".", 2)[2] == block[0][0]:
            out += [(f"blk.{i}.{sub}", np_shape(bne)) for i in range(layers) for sub, bne in block]
    return out


def write_synthetic(shape: Shape, dst: Path, template: Path, seed: int = 0) -> None:
    """An F16 GGUF of `shape`: the template's metadata (architecture, tokenizer, chat template)
    with the shape's layer count and widths, its tensor set for that many layers, random
    weights (normal, std 0.02; norms 1)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(template))
    arch = reader.fields["general.architecture"].contents()
    arch_kv = {k.removeprefix(f"{arch}."): f.contents() for k, f in reader.fields.items()
               if k.startswith(f"{arch}.")}
    dims = _dims(shape, arch_kv)
    keys: dict[str, int | float] = {"block_count": shape.layers, **shape.overrides}
    if shape.widths is not None:
        n_embd, n_ff, n_head, n_kv = shape.widths
        keys.update({"embedding_length": n_embd, "feed_forward_length": n_ff,
                     "attention.head_count": n_head, "attention.head_count_kv": n_kv})
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(dst)
    writer = gguf.GGUFWriter(str(tmp), arch)
    skip = {"general.architecture", "general.file_type", "general.quantization_version",
            "general.name", "general.size_label", "general.finetune", "general.basename"}
    for k, f in reader.fields.items():
        if k.startswith("GGUF.") or k in skip:
            continue
        sub = k.removeprefix(f"{arch}.")
        if k.startswith(f"{arch}.") and sub in keys:
            continue
        vtype = f.types[0]
        writer.add_key_value(k, f.contents(), vtype,
                             f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for sub, val in keys.items():
        key = f"{arch}.{sub}"
        if isinstance(val, float):
            writer.add_float32(key, val)
        else:
            writer.add_uint32(key, val)
    writer.add_string("general.name", f"synthetic {shape.name} (random weights, {shape.published})")
    writer.add_string("edgekv.synthetic", shape.name)
    writer.add_uint32("general.file_type", WEIGHT_TYPES["f16"])
    tensors = tensor_set([(t.name, [int(d) for d in t.shape]) for t in reader.tensors],
                         shape.layers, dims)
    for name, np_shape in tensors:
        dtype = np.float32 if len(np_shape) == 1 else np.float16
        writer.add_tensor_info(name, np_shape, np.dtype(dtype),
                               int(np.prod(np_shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, np_shape in tensors:
        if len(np_shape) == 1:
            writer.write_tensor_data(np.ones(np_shape, dtype=np.float32))
        else:
            w = rng.standard_normal(np_shape, dtype=np.float32) * np.float32(0.02)
            writer.write_tensor_data(w.astype(np.float16))
    writer.close()
    os.replace(tmp, dst)


def model_params(path: Path) -> int:
    """The parameter count of a GGUF (elements of every tensor)."""
    import gguf

    return int(sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+", help="smollm2-<type> or synthetic-<shape>-<type>")
    ap.add_argument("--cache-dir", type=Path, help="default: $EDGEKV_CACHE_DIR or ~/.cache/edgekv")
    ap.add_argument("--llama-quantize", type=Path, help="a llama-quantize binary (default: "
                    "llama-cpp-python's llama_model_quantize)")
    args = ap.parse_args(argv)
    from edgekv.config import default_cache_dir

    cache = args.cache_dir or default_cache_dir()
    for n in args.names:
        p = ensure_model(n, cache, args.llama_quantize,
                         progress=lambda m: print(m, file=sys.stderr))
        print(f"{n}\t{p}\t{p.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
