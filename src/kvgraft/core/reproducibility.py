"""Run-to-run reproducibility of CPU arithmetic: what kvgraft sets before torch computes, and what it records.

oneMKL, torch's CPU BLAS, does not promise the same bits from run to run unless Conditional Numerical
Reproducibility (CNR) is on: without it, it chooses code paths by the memory alignment of the operands and may
order parallel work differently from one call to the next; and its dynamic threading (on in a process that never
calls `torch.set_num_threads`) may run a call on fewer threads than asked. benchmarks/determinism.py measures the
effect under CPU load; the README's exactness section has the figures.

`configure()` sets, unless the user set them already:
- `MKL_CBWR` (CNR mode) and `MKL_DYNAMIC`, `OMP_DYNAMIC` in the environment: MKL and OpenMP read them once, when
  first used, so this must happen before torch computes anything; importing kvgraft does it;
- the thread count, pinned through `torch.set_num_threads` (which also turns MKL's dynamic threading off).

`settings()` reads back what the libraries actually use. The fingerprint's `environment` records it, so a graft
built under other settings (or in a process where MKL started before kvgraft could set them) is refused like any
other environment difference.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Any

# CNR mode for MKL: AUTO picks the best code path for this CPU and keeps to it; STRICT also makes the supported
# routines (the GEMMs among them) independent of the thread count.
MKL_CBWR = "AUTO,STRICT"
ENVIRONMENT = {"MKL_CBWR": MKL_CBWR, "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}

# mkl_cbwr_get(MKL_CBWR_ALL) values (mkl_cbwr.h)
_CBWR_BRANCHES = {
    0: "OFF",
    1: "OFF",  # MKL_CBWR_BRANCH_OFF: CNR not enabled
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    12: "AVX512",
    14: "AVX512_E1",
}
_CBWR_STRICT = 0x10000
_CBWR_ALL = -1


def configure() -> None:
    """Put the reproducibility settings in place (idempotent). Settings the user made explicitly are kept: they
    are recorded in the fingerprint like any other, so grafts made under different ones are refused."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    import torch

    # Pins MKL's and OpenMP's thread count to torch's and turns MKL's dynamic threading off.
    torch.set_num_threads(torch.get_num_threads())


def settings() -> dict[str, Any]:
    """What the numeric libraries in this process actually use: `mkl_cbwr` (e.g. "AUTO,STRICT", "OFF"),
    `mkl_dynamic`, `omp_dynamic` (booleans); "none" where the library is absent."""
    return {"mkl_cbwr": _mkl_cbwr(), "mkl_dynamic": _mkl_dynamic(), "omp_dynamic": _omp_dynamic()}


@functools.cache
def _torch_library(name: str) -> ctypes.CDLL | None:
    """A shared library torch ships (already loaded by `import torch`: this returns the same instance)."""
    import torch

    path = Path(torch.__file__).parent / "lib" / name
    try:
        return ctypes.CDLL(str(path)) if path.exists() else None
    except OSError:
        return None


def _symbol(library: str, name: str) -> Any:
    lib = _torch_library(library)
    function = getattr(lib, name, None) if lib is not None else None
    if function is not None:
        function.restype = ctypes.c_int
    return function


def _mkl_cbwr() -> str:
    get = _symbol("libtorch_cpu.so", "mkl_serv_cbwr_get")
    if get is None:
        return "none"
    get.argtypes = [ctypes.c_int]
    value = int(get(_CBWR_ALL))
    branch = _CBWR_BRANCHES.get(value & ~_CBWR_STRICT, f"0x{value & ~_CBWR_STRICT:x}")
    return branch + (",STRICT" if value & _CBWR_STRICT else "")


def _mkl_dynamic() -> bool | str:
    get = _symbol("libtorch_cpu.so", "mkl_serv_get_dynamic")
    return bool(get()) if get is not None else "none"


def _omp_dynamic() -> bool | str:
    get = _symbol("libgomp.so.1", "omp_get_dynamic")
    return bool(get()) if get is not None else "none"
