"""Which KV a reused prefix needs, per layer, when some layers attend through a sliding window.

A global (full-attention) layer attends to every earlier position, so resuming after a prefix
of P tokens needs its KV for [0, P). A sliding-window (local) layer of window w lets position p
see (p - w, p] only (llama.cpp `is_masked_swa`, standard type: masked when p - p0 >= w), so the
tokens from P on need [P - w + 1, P); llama.cpp's own per-sequence state keeps [P - w, P), and
so does EdgeKV. For Gemma 3 270M (18 layers, 15 local with w = 512, f16 KV of 512 values per
layer and token) a 1,500-token prefix needs 1,500 x 3 global + 512 x 15 local layer-rows
instead of 1,500 x 18.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedLayout

__all__ = ["WindowLayout", "window_layout"]


@dataclass(frozen=True, slots=True)
class WindowLayout:
    """The attention span of each layer: `swa_layers` see the last `n_swa` positions."""

    n_layer: int
    swa_layers: tuple[int, ...] = ()
    n_swa: int = 0

    def __post_init__(self) -> None:
        if self.swa_layers and self.n_swa < 1:
            raise ValueError(f"sliding-window layers need a window >= 1, got {self.n_swa}")
        if any(not 0 <= i < self.n_layer for i in self.swa_layers):
            raise ValueError(f"sliding-window layers {self.swa_layers} outside the model's "
                             f"{self.n_layer}")

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layer) if i not in self.swa_layers)

    def needed_from(self, layer: int, n: int) -> int:
        """The first position of `layer` that a prefix of `n` tokens needs."""
        return max(0, n - self.n_swa) if layer in self.swa_layers else 0

    def rows_needed(self, n: int) -> int:
        """Layer x token rows of KV that resuming after `n` tokens needs."""
        return sum(n - self.needed_from(layer, n) for layer in range(self.n_layer))

    def bytes_needed(self, n: int, bytes_per_row: int) -> int:
        """Bytes of KV that resuming after `n` tokens needs (`bytes_per_row`: K + V of one
        layer and token)."""
        return self.rows_needed(n) * bytes_per_row


# Sliding-window patterns llama.cpp 0.3.36 applies when the GGUF names none
# (`load_swa_pattern(ml, n_pattern, dense_first)` in src/models/<arch>.cpp): every
# n_pattern-th layer is global, the others local. Architectures with a window that are not
# here (and whose GGUF has no pattern) are refused: their state layout is not known.
_SWA_PATTERNS: dict[str, tuple[int, bool]] = {"gemma3": (6, False)}


def window_layout(metadata: dict[str, str], n_layer: int) -> WindowLayout:
    """The model's sliding-window layers and window, from its GGUF metadata (llama.cpp's
    `llama_hparams::set_swa_pattern`); refused where the pattern is not known."""
    arch = metadata.get("general.architecture", "unknown")
    n_swa = int(float(metadata.get(f"{arch}.attention.sliding_window", 0) or 0))
    if n_swa <= 0:
        return WindowLayout(n_layer)
    raw = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if raw is not None and str(raw).strip().lstrip("-").isdigit():
        pattern, dense_first = int(str(raw).strip()), False
    elif raw is None and arch in _SWA_PATTERNS:
        pattern, dense_first = _SWA_PATTERNS[arch]
    else:
        why = ("a per-layer pattern EdgeKV cannot read" if raw is not None
               else "no pattern in its GGUF")
        raise UnsupportedLayout(
            f"{arch} has a {n_swa}-token sliding window with {why}; its KV state layout is not "
            "known to EdgeKV, so KV reuse is refused for it")
    if pattern <= 0:
        swa = tuple(range(n_layer))
    elif dense_first:
        swa = tuple(i for i in range(n_layer) if i % pattern != 0)
    else:
        swa = tuple(i for i in range(n_layer) if i % pattern < pattern - 1)
    return WindowLayout(n_layer, swa, n_swa)
