"""SparKV cost model: what a chunk costs to compute here and to fetch from the server.

- Network: bandwidth and RTT as EWMAs of observed transfers (time to first byte, then bytes
  over time); loss as an EWMA of failed streams; the wire/raw size ratio of the codec.
- Device: prefill time of one chunk as a function of its position, t(i) = a + b*i (later
  chunks attend to more cells), least-squares over calibration runs and every chunk the
  executor computes; inject time per byte.
- Energy: J per computed token (CPU power x time) and J per received byte (radio), labelled
  estimated (see `energy.py` for the constants and where a real probe replaces them).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..energy import CPU_W_PER_BUSY_CORE

__all__ = ["CostModel", "RADIO_J_PER_BYTE", "RADIO_W_ACTIVE"]

# Wi-Fi/LTE receive energy is ~50-200 nJ per byte on phones; 100 nJ/B as the nominal value,
# plus the radio's active power while a transfer is under way (~0.5-1.3 W on phones).
RADIO_J_PER_BYTE = 100e-9
RADIO_W_ACTIVE = 0.8


@dataclass
class CostModel:
    bandwidth_Bps: float = 20e6 / 8  # prior until something is observed
    rtt_s: float = 0.02
    loss: float = 0.0
    wire_ratio: float = 0.93  # f16 KV compresses little with zstd
    prefill_a_s: float = 0.25
    prefill_b_s: float = 0.01
    inject_s_per_byte: float = 0.3e-9
    inject_base_s: float = 0.002
    cores: int = 2
    alpha: float = 0.3
    _obs: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=64))
    _seen: set[str] = field(default_factory=set)  # estimates that have had a real observation

    # -- observations ------------------------------------------------------------------

    def _ewma(self, name: str, old: float, new: float) -> float:
        """The first real observation replaces the prior; later ones are averaged in."""
        if name not in self._seen:
            self._seen.add(name)
            return new
        return (1 - self.alpha) * old + self.alpha * new

    def observe_rtt(self, seconds: float) -> None:
        self.rtt_s = self._ewma("rtt", self.rtt_s, max(seconds, 0.0))

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if seconds > 1e-4 and nbytes > 0:
            self.bandwidth_Bps = self._ewma("bw", self.bandwidth_Bps, nbytes / seconds)

    def observe_wire_ratio(self, wire: int, raw: int) -> None:
        if raw > 0:
            self.wire_ratio = self._ewma("ratio", self.wire_ratio, wire / raw)

    def observe_failure(self, failed: bool) -> None:
        self.loss = self._ewma("loss", self.loss, 1.0 if failed else 0.0)

    def observe_prefill(self, chunk_index: int, seconds: float) -> None:
        self._obs.append((chunk_index, seconds))
        xs = np.array([o[0] for o in self._obs], float)
        ys = np.array([o[1] for o in self._obs], float)
        if len(set(xs.tolist())) >= 2:
            b, a = np.polyfit(xs, ys, 1)
            self.prefill_a_s, self.prefill_b_s = float(max(a, 1e-4)), float(max(b, 0.0))
        else:
            self.prefill_a_s = float(ys.mean() - self.prefill_b_s * xs.mean())

    def calibrate(self, adapter: object, chunk_size: int,
                  positions: Sequence[int] = (0, 3)) -> None:
        """Time real prefills of one chunk at a few positions on this device."""
        a = adapter
        filler = [int(t) for t in range(100, 100 + chunk_size)]
        for pos in positions:
            a.clear_kv_cache()  # type: ignore[attr-defined]
            if pos:
                a.prefill(filler * pos, align=chunk_size)  # type: ignore[attr-defined]
            t = time.perf_counter()
            a.prefill(filler, align=chunk_size)  # type: ignore[attr-defined]
            self.observe_prefill(pos, time.perf_counter() - t)
        a.clear_kv_cache()  # type: ignore[attr-defined]

    # -- predictions -------------------------------------------------------------------

    def compute_s(self, chunk_index: int) -> float:
        return self.prefill_a_s + self.prefill_b_s * chunk_index

    def wire_bytes(self, raw_bytes: int) -> int:
        return int(raw_bytes * self.wire_ratio) + 64

    def transfer_s(self, wire_bytes: int) -> float:
        return wire_bytes / max(self.bandwidth_Bps, 1.0) / max(1e-3, 1.0 - self.loss)

    def inject_s(self, raw_bytes: int) -> float:
        return self.inject_base_s + raw_bytes * self.inject_s_per_byte

    def compute_j(self, chunk_index: int) -> float:
        return self.compute_s(chunk_index) * CPU_W_PER_BUSY_CORE * self.cores

    def receive_j(self, wire_bytes: int) -> float:
        return wire_bytes * RADIO_J_PER_BYTE + self.transfer_s(wire_bytes) * RADIO_W_ACTIVE
