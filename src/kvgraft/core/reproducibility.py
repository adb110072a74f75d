"""Run-to-run reproducibility of CPU arithmetic: what kvgraft sets before torch computes, and what it records.

oneMKL, torch's CPU BLAS, does not promise the same bits from run to run unless Conditional Numerical
Reproducibility (CNR) is on: without it, it chooses code paths by the memory alignment of the operands and may
order parallel work differently from one call to the next; and its dynamic threading (on in a process that never
calls `torch.set_num_threads`) may run a call on fewer threads than asked. benchmarks/determinism.py measures the
effect under CPU load; the README's exactness section has the figures.

`configure()` sets, unless the user set them already:
- `MKL_CBWR` (CNR mode) and `MKL_DYNAMIC`, `OMP_DYNAMIC` in the environment: MKL and OpenMP read them once, when
  first used, so this must happen before torch computes anything; importing kvgraft does it;
- the thread count, pinned through `torch.set_num_threads` (which also turns MKL's dynamic threading off):
  $KVGRAFT_THREADS, else $OMP_NUM_THREADS, else `default_threads()` (half the available CPUs, at most 4).

The thread count is part of the fingerprint (fp32 attention sums in another order on another count), but any
machine can run any count: `threads(n)` runs a block at a graft's count, so that a graft made elsewhere is used
exactly instead of being refused. OpenMP and MKL keep the count per OS thread; torch hands its last count to OS
threads started later, and a thread that computes (the server's model worker) pins its own.

On a CUDA device (`configure_cuda()`, called when a model is first put on one) kvgraft also asks for deterministic
algorithms, the cuBLAS workspace setting they need (`CUBLAS_WORKSPACE_CONFIG`, which cuBLAS reads when its first
handle is made: `configure()` sets it at import, before anything can start CUDA), cuDNN without autotuning, and
TF32 off (TF32 rounds fp32 matmul inputs to 10 mantissa bits, on some GPUs only). `cuda_settings()` reads these
back, with the scaled-dot-product-attention backends torch may pick from, and CUDA fingerprints record them.
They are process-wide switches, so the CPU (whose fingerprint does not record them) is left alone until CUDA is
asked for.

`settings()` reads back what the libraries actually use. The fingerprint's `environment` records it, so a graft
built under other settings (or in a process where MKL started before kvgraft could set them) is refused like any
other environment difference.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.core.errors import BadInputError

THREADS_ENV = "KVGRAFT_THREADS"
"""The thread count of every kvgraft run in this process, unless a command's `--threads` says otherwise."""
MAX_DEFAULT_THREADS = 4
MAX_THREADS = 1024

# CNR mode for MKL: AUTO picks the best code path for this CPU and keeps to it; STRICT also makes the supported
# routines (the GEMMs among them) independent of the thread count.
MKL_CBWR = "AUTO,STRICT"
ENVIRONMENT = {"MKL_CBWR": MKL_CBWR, "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS's workspace setting under which its GEMMs are deterministic (what torch asks for in deterministic mode)."""
CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
SDPA_BACKENDS = ("flash", "mem_efficient", "math", "cudnn")

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
    # Read by cuBLAS when CUDA first makes a handle, which may happen before any kvgraft code sees a device.
    os.environ.setdefault(CUBLAS_ENV, CUBLAS_WORKSPACE_CONFIG)
    # Pins MKL's and OpenMP's thread count and turns MKL's dynamic threading off. A malformed $KVGRAFT_THREADS
    # is not an import error: the CLI reports it when a command resolves its thread count.
    try:
        count = requested_threads()
    except BadInputError:
        count = default_threads()
    set_threads(count)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: what a container or `taskset` leaves it), not the
    machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_threads(cpus: int | None = None) -> int:
    """kvgraft's default thread count: half the available CPUs, at least 1, at most `MAX_DEFAULT_THREADS`.

    Why not torch's own default (every core): torch's OpenMP threads spin at each barrier, so a parallel region
    waits for whichever of its threads the OS has descheduled. With a thread per core, any other busy process
    (a tokenizer, the server's event loop, another job) costs far more than its share; benchmarks/threads.py
    measures it. Half the CPUs leaves room for the rest of the machine, and the cap keeps the count, which is
    part of a graft's fingerprint, the same on every machine with 2 * MAX_DEFAULT_THREADS CPUs or more.

    Args:
        cpus: the CPUs to count; None for `available_cpus()`.

    Returns:
        The thread count.
    """
    cpus = available_cpus() if cpus is None else cpus
    return max(1, min(MAX_DEFAULT_THREADS, cpus // 2))


def parse_threads(value: str | int, source: str) -> int:
    """A thread count from an option or the environment.

    Args:
        value: the text (or number) given.
        source: where it came from, for the error ("--threads", "$KVGRAFT_THREADS").

    Returns:
        The count.

    Raises:
        BadInputError: not a positive integer.
    """
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1 or count > MAX_THREADS:
        raise BadInputError(f"{source} must be an integer from 1 to {MAX_THREADS}, got {value!r}")
    return count


def requested_threads(threads: int | None = None) -> int:
    """The thread count a run uses: `threads` if given, else $KVGRAFT_THREADS, else $OMP_NUM_THREADS (torch reads
    it too: a user who set it meant it), else `default_threads()`.

    Args:
        threads: an explicit count (`--threads`), or None.

    Returns:
        The count.

    Raises:
        BadInputError: `threads` or $KVGRAFT_THREADS is not a positive integer.
    """
    if threads is not None:
        return parse_threads(threads, "the thread count")
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        return parse_threads(value, f"${THREADS_ENV}")
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        import torch

        return int(torch.get_num_threads())
    return default_threads()


def current_threads() -> int:
    """torch's thread count in the calling OS thread (OpenMP keeps it per thread)."""
    import torch

    return int(torch.get_num_threads())


def set_threads(count: int) -> None:
    """Pin torch, OpenMP and MKL to `count` threads in the calling OS thread; OS threads started later inherit it.

    Args:
        count: the thread count, at least 1.
    """
    import torch

    # torch initialises an OS thread's count from its last process-wide count on that thread's first use, which
    # would undo a count set before it (if another thread set another since): have that first use happen now.
    torch.get_num_threads()
    # Also at the same count: set_num_threads turns MKL's dynamic threading off, and is cheap when nothing changes.
    torch.set_num_threads(count)


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """Run the body with `count` threads, then go back to the calling thread's previous count.

    Args:
        count: the thread count for the body.
    """
    previous = current_threads()
    set_threads(count)
    try:
        yield
    finally:
        set_threads(previous)


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


@dataclass(frozen=True, kw_only=True)
class CudaSettings:
    """The switches that decide whether CUDA arithmetic repeats bit for bit, as the process has them now."""

    deterministic_algorithms: bool
    """`torch.are_deterministic_algorithms_enabled()`: nondeterministic kernels raise instead of running."""
    cublas_workspace_config: str
    """$CUBLAS_WORKSPACE_CONFIG ("none" when unset): `:4096:8` or `:16:8` make cuBLAS deterministic."""
    tf32_matmul: bool
    """`torch.backends.cuda.matmul.allow_tf32`: fp32 matmuls rounded to TF32 (off for kvgraft)."""
    tf32_cudnn: bool
    """`torch.backends.cudnn.allow_tf32` (off for kvgraft)."""
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    """cuDNN autotuning, which may pick another kernel from run to run (off for kvgraft)."""
    sdpa_backends: tuple[str, ...]
    """The scaled-dot-product-attention backends torch may choose from, of `SDPA_BACKENDS`."""

    def to_json(self) -> dict[str, Any]:
        """The fingerprint's entries: the fields by name, `sdpa_backends` as a list."""
        return {
            "deterministic_algorithms": self.deterministic_algorithms,
            "cublas_workspace_config": self.cublas_workspace_config,
            "tf32_matmul": self.tf32_matmul,
            "tf32_cudnn": self.tf32_cudnn,
            "cudnn_deterministic": self.cudnn_deterministic,
            "cudnn_benchmark": self.cudnn_benchmark,
            "sdpa_backends": list(self.sdpa_backends),
        }


def configure_cuda() -> None:
    """Make CUDA arithmetic repeatable (idempotent): deterministic algorithms, cuBLAS's deterministic workspace,
    cuDNN deterministic and not autotuned, TF32 off. Called before a model is put on a CUDA device.

    A $CUBLAS_WORKSPACE_CONFIG the user set is kept (and recorded). The SDPA backends are left as torch chooses:
    their forward passes are deterministic, and which ones were allowed is recorded.
    """
    import torch

    os.environ.setdefault(CUBLAS_ENV, CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def cuda_settings() -> CudaSettings:
    """The CUDA reproducibility switches as they are now (readable on any build of torch, with or without CUDA)."""
    import torch

    enabled = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
    }
    return CudaSettings(
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        cublas_workspace_config=os.environ.get(CUBLAS_ENV, "none"),
        tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
        tf32_cudnn=bool(torch.backends.cudnn.allow_tf32),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        sdpa_backends=tuple(name for name in SDPA_BACKENDS if enabled[name]),
    )
