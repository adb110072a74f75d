"""Energy, only where a counter can be read: NVML's energy counter on a GPU, the powercap/RAPL counter on a CPU.

Elsewhere the meter says "not measured"; it never estimates. On a GPU the counter read is the model's own GPU
(`cuda:N`), not whichever GPU NVML happens to number 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.core.errors import BadInputError

_RAPL = Path("/sys/class/powercap/intel-rapl:0/energy_uj")
_DEVICE_PATTERN = re.compile(r"([a-z]+)(?::(\d+))?")


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


def cuda_index(device: str, current_device: int | None = None) -> int | None:
    """The CUDA device index a device name means (pure: the caller says which device is current).

    Args:
        device: a torch device name (`cpu`, `cuda`, `cuda:N`, `mps`, ...), or `str()` of a torch device.
        current_device: `torch.cuda.current_device()` when CUDA is available, else None.

    Returns:
        N for `cuda:N`; for a bare `cuda`, the current device (0 when there is none); None for a device that is not
        CUDA.

    Raises:
        BadInputError: a name that is not a device name (`cuda:x`, `cuda:-1`, "").
    """
    match = _DEVICE_PATTERN.fullmatch(device.strip().lower())
    if match is None:
        raise BadInputError(f"unknown device {device!r} for the energy meter; use cpu, cuda, cuda:N or mps")
    if match.group(1) != "cuda":
        return None
    if match.group(2) is not None:
        return int(match.group(2))
    return current_device if current_device is not None else 0


class EnergyMeter:
    """Reads an energy counter at start and stop (NVML on a CUDA device, else RAPL when readable)."""

    def __init__(self, device: str = "cpu") -> None:
        """Pick the counter for a device.

        Args:
            device: the model's device as `str(model.device)`: `cuda:N` reads GPU N's counter; a bare `cuda` reads
                the current CUDA device's; any other device reads RAPL.

        Raises:
            BadInputError: `device` is not a device name.
        """
        index = cuda_index(device, _current_cuda_device() if device.strip().lower() == "cuda" else None)
        self.device_index = index
        """the CUDA device whose counter is read; None off CUDA"""
        self._read, self.source = _nvml_counter(index) if index is not None else _rapl_counter()
        self._start: float | None = None

    def start(self) -> None:
        """Read the counter: the reading `stop` subtracts."""
        self._start = self._read() if self._read else None

    def stop(self) -> EnergyReading:
        """Returns: the energy used since `start` (joules None when there is no counter)."""
        if self._read is None or self._start is None:
            return EnergyReading(joules=None, source=self.source)
        return EnergyReading(joules=self._read() - self._start, source=self.source)


def _current_cuda_device() -> int | None:
    """torch's current CUDA device, or None when this machine has no CUDA (asking starts nothing then)."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _nvml_counter(index: int) -> tuple[Callable[[], float] | None, str]:
    """NVML's energy counter of CUDA device `index`, in joules, or why it cannot be read.

    NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, so the GPU is found by the UUID torch reports
    for `cuda:index`; by the index itself only when torch cannot say.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = _nvml_handle(pynvml, index)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # a GPU without the counter fails here, not mid-run
        return (lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0), "nvml"
    except Exception:  # no NVML, no such GPU or no counter on it: say so, never guess
        return None, f"not measured (NVML energy counter of cuda:{index} not readable)"


def _nvml_handle(pynvml: Any, index: int) -> Any:
    """NVML's handle of `cuda:index`: by torch's UUID for it when torch has CUDA, else by the index."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None) if torch.cuda.is_available() else None
    if uuid is None:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    # torch prints the bare UUID; NVML names a GPU "GPU-<uuid>" (bytes: every pynvml version accepts them).
    return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}".encode())


def _rapl_counter() -> tuple[Callable[[], float] | None, str]:
    """The powercap/RAPL package counter, in joules, or why it cannot be read."""
    try:
        int(_RAPL.read_text())
        return (lambda: int(_RAPL.read_text()) / 1e6), "rapl"
    except (OSError, ValueError):
        return None, "not measured (no readable powercap/RAPL counter)"
