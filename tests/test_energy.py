"""The energy meter reads the counter of the model's own device: `cuda:N` is GPU N, never always GPU 0.

No GPU is needed: the device-index parsing is a pure function, and off CUDA (or without NVML) the meter says in
one exact line that it did not measure, or names the RAPL counter it reads.
"""

from __future__ import annotations

import pytest
import torch

from kvgraft.core.errors import BadInputError
from kvgraft.flywheel import energy
from kvgraft.flywheel.energy import EnergyMeter, cuda_index


@pytest.mark.parametrize(
    ("device", "current", "index"),
    [
        ("cuda:0", None, 0),
        ("cuda:3", None, 3),
        ("cuda:3", 1, 3),  # a named index wins over the current device
        ("cuda", None, 0),
        ("cuda", 2, 2),
        (" CUDA:1 ", None, 1),
        (str(torch.device("cuda", 5)), None, 5),
        ("cpu", None, None),
        ("cpu", 2, None),
        ("mps", None, None),
        ("meta", None, None),
    ],
)
def test_cuda_index_of_a_device_name(device: str, current: int | None, index: int | None) -> None:
    assert cuda_index(device, current) == index


@pytest.mark.parametrize("device", ["cuda:x", "cuda:-1", "cuda:", "", "cuda:1:2", "gpu 0"])
def test_cuda_index_refuses_what_is_not_a_device_name(device: str) -> None:
    with pytest.raises(BadInputError) as caught:
        cuda_index(device)
    assert str(caught.value) == f"unknown device {device!r} for the energy meter; use cpu, cuda, cuda:N or mps"


def rapl_readable() -> bool:
    try:
        int(energy._RAPL.read_text())
    except (OSError, ValueError):
        return False
    return True


@pytest.mark.parametrize("device", ["cpu", "mps", "meta"])
def test_a_meter_off_cuda_reads_rapl_or_says_it_did_not_measure(device: str) -> None:
    meter = EnergyMeter(device)
    assert meter.device_index is None
    meter.start()
    reading = meter.stop()
    if rapl_readable():
        assert (meter.source, reading.source) == ("rapl", "rapl")
        assert isinstance(reading.joules, float)
    else:
        assert meter.source == "not measured (no readable powercap/RAPL counter)"
        assert reading.to_json() == {"joules": None, "source": "not measured (no readable powercap/RAPL counter)"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here may have a readable NVML counter")
@pytest.mark.parametrize(("device", "index"), [("cuda:1", 1), ("cuda", 0), ("cuda:0", 0)])
def test_a_cuda_meter_without_a_gpu_names_the_device_it_could_not_read(device: str, index: int) -> None:
    meter = EnergyMeter(device)
    assert meter.device_index == index
    meter.start()
    assert meter.stop().to_json() == {
        "joules": None,
        "source": f"not measured (NVML energy counter of cuda:{index} not readable)",
    }


def test_a_meter_refuses_a_bad_device_name() -> None:
    with pytest.raises(BadInputError, match="unknown device 'cuda:x' for the energy meter"):
        EnergyMeter("cuda:x")
