"""Energy, only where a counter can be read: NVML's energy counter on a GPU, the powercap/RAPL counter on a CPU.

Elsewhere the meter says "not measured"; it never estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

_RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")


@dataclass(frozen=True, kw_only=True)
class EnergyReading:
    """Energy used between a meter's start and stop."""

    joules: float | None
    """None when no counter could be read"""
    source: str
    """the counter read ("nvml", "rapl"), or why none was ("not measured (...)")"""

    def to_json(self) -> dict[str, Any]:
        """Returns: {"joules", "source"}."""
        return {"joules": self.joules, "source": self.source}


class EnergyMeter:
    """Reads an energy counter at start and stop (NVML on a CUDA device, else RAPL when readable)."""

    def __init__(self, device: str = "cpu") -> None:
        """Pick the counter for a device.

        Args:
            device: a torch device type ("cuda", "cpu", ...).
        """
        self._read, self.source = self._pick(device)
        self._start: float | None = None

    @staticmethod
    def _pick(device: str) -> tuple[Any, str]:
        if device.startswith("cuda"):
            try:
                import pynvml

                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByIndex(0)
                return (lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0), "nvml"
            except Exception:  # no NVML or no counter on this GPU: say so, never guess
                return None, "not measured (NVML energy counter not readable)"
        try:
            int(_RAPL.read_text())
            return (lambda: int(_RAPL.read_text()) / 1e6), "rapl"
        except (OSError, ValueError):
            return None, "not measured (no readable powercap/RAPL counter)"

    def start(self) -> None:
        """Read the counter: the reading `stop` subtracts."""
        self._start = self._read() if self._read else None

    def stop(self) -> EnergyReading:
        """Returns: the energy used since `start` (joules None when there is no counter)."""
        if self._read is None or self._start is None:
            return EnergyReading(joules=None, source=self.source)
        return EnergyReading(joules=self._read() - self._start, source=self.source)
