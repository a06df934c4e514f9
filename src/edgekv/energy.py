"""Energy: a real probe where the platform has one, otherwise a documented model.

Probes (measured):
- Linux RAPL: `/sys/class/powercap/intel-rapl:*/energy_uj` (package energy counter, uJ).
- Android: `/sys/class/power_supply/*/current_now` (uA) x `voltage_now` (uV), sampled.

Model (estimated), used when no probe is readable (as in this VM):
    E = cpu_seconds x CPU_W_PER_BUSY_CORE + dram_bytes x DRAM_J_PER_BYTE
- CPU_W_PER_BUSY_CORE = 3.0 W: a big mobile/embedded core at full load draws ~2-4 W
  (Cortex-A78-class); one value for every mode, so ratios between modes are what it shows.
- DRAM_J_PER_BYTE = 60 pJ/B: LPDDR4x access + I/O energy is ~4-8 pJ/bit.
mAh are given at 3.85 V, a typical phone battery's nominal voltage.
Every figure is labelled with its source; an estimate is never reported as a measurement.
"""

from __future__ import annotations

import glob
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CPU_W_PER_BUSY_CORE", "DRAM_J_PER_BYTE", "EnergyMeter", "EnergyReading",
           "joules_to_mah"]

CPU_W_PER_BUSY_CORE = 3.0
DRAM_J_PER_BYTE = 60e-12
BATTERY_VOLTS = 3.85


def joules_to_mah(joules: float, volts: float = BATTERY_VOLTS) -> float:
    return joules / volts / 3.6


@dataclass(frozen=True, slots=True)
class EnergyReading:
    joules: float
    source: str  # "measured" or "estimated"
    method: str


def _rapl_files(sysfs: str) -> list[Path]:
    out = []
    for p in glob.glob(f"{sysfs}/class/powercap/intel-rapl:*/energy_uj"):
        path = Path(p)
        if path.parent.name.count(":") == 1:  # packages only, not sub-zones
            try:
                int(path.read_text())
                out.append(path)
            except (OSError, ValueError):
                pass
    return out


def _battery(sysfs: str) -> tuple[Path, Path] | None:
    for d in sorted(glob.glob(f"{sysfs}/class/power_supply/*")):
        cur, volt = Path(d, "current_now"), Path(d, "voltage_now")
        try:
            int(cur.read_text())
            int(volt.read_text())
            return cur, volt
        except (OSError, ValueError):
            continue
    return None


class EnergyMeter:
    """Measure one span of work: `start()`, then `stop(cpu_s, dram_bytes)`.

    On Android the battery's current x voltage is sampled every `period_s` on a thread and
    integrated (discharge current is what the device draws; the sign convention varies by
    vendor, so the magnitude is used).
    """

    def __init__(self, sysfs: str = "/sys", period_s: float = 0.01) -> None:
        self._rapl = _rapl_files(sysfs)
        self._battery = None if self._rapl else _battery(sysfs)
        self._period = period_s
        self._e0: list[int] = []
        self._joules = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def source(self) -> str:
        return "measured" if (self._rapl or self._battery) else "estimated"

    def start(self) -> None:
        self._e0 = [int(p.read_text()) for p in self._rapl]
        if self._battery:
            self._joules = 0.0
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        assert self._battery is not None
        cur, volt = self._battery
        last = time.perf_counter()
        while not self._stop.wait(self._period):
            now = time.perf_counter()
            try:
                watts = abs(int(cur.read_text())) * 1e-6 * int(volt.read_text()) * 1e-6
            except (OSError, ValueError):
                continue
            self._joules += watts * (now - last)
            last = now

    def stop(self, cpu_s: float, dram_bytes: float) -> EnergyReading:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            return EnergyReading(self._joules, "measured", "battery current_now x voltage_now")
        if self._rapl:
            e1 = [int(p.read_text()) for p in self._rapl]
            uj = sum((b - a) % (1 << 32) if b < a else b - a for a, b in zip(self._e0, e1))
            return EnergyReading(uj / 1e6, "measured", "RAPL package energy")
        j = cpu_s * CPU_W_PER_BUSY_CORE + dram_bytes * DRAM_J_PER_BYTE
        return EnergyReading(j, "estimated",
                             f"cpu_s x {CPU_W_PER_BUSY_CORE} W + bytes x {DRAM_J_PER_BYTE:g} J/B")
