"""The options several commands share, so that each is spelled and documented once."""

from __future__ import annotations

from typing import Annotated

import typer

from kvgraft.cli.engines import DEFAULT_DTYPE, FALLBACK_MODEL
from kvgraft.core import reproducibility
from kvgraft.core.schedule import DEFAULT_CHUNK_SIZE
from kvgraft.models.loading import CUDA_DTYPE, DEVICES_HELP

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="random:<arch>[:<seed>], a local HF model directory, or a hub id. "
        f"Defaults to the graft's own model, else {FALLBACK_MODEL}.",
    ),
]
StoreOpt = Annotated[
    str | None, typer.Option("--store", "-s", help="Store directory (default: $KVGRAFT_STORE or ./.kvgraft).")
]
SharedCacheOpt = Annotated[
    str | None,
    typer.Option("--shared-cache", help="Cache blocks in Redis, shared between processes: redis://HOST:PORT/DB."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
ChunkOpt = Annotated[
    int | None,
    typer.Option(
        "--chunk-size", "-C", help=f"Chunk size C of the schedule (default: the graft's, else {DEFAULT_CHUNK_SIZE})."
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help=f"float32, bfloat16 or float16 (default: the graft's, else {DEFAULT_DTYPE} on cpu/mps, "
        f"{CUDA_DTYPE} on cuda).",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        envvar="KVGRAFT_DEVICE",
        show_envvar=True,
        help=f"Where the model runs: {DEVICES_HELP}. On CUDA, deterministic kernels and no TF32 (recorded in "
        "grafts' fingerprints); a graft made on another device needs --allow-env-mismatch.",
    ),
]
EnvOpt = Annotated[
    bool,
    typer.Option(
        "--allow-env-mismatch", help="Use grafts made under another numeric environment; results say 'not exact'."
    ),
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        help="With --ray: the cluster, HOST:PORT or ray://HOST:PORT (default: $RAY_ADDRESS, else a local Ray).",
    ),
]
WorkersOpt = Annotated[int | None, typer.Option("--workers", min=1, help="With --ray: actors (default 2).")]
CpusPerWorkerOpt = Annotated[
    float | None, typer.Option("--cpus-per-worker", min=0.01, help="With --ray: CPUs per actor (default 1).")
]
TrustedKeysOpt = Annotated[
    str | None,
    typer.Option(
        "--trusted-keys",
        envvar="KVGRAFT_TRUSTED_KEYS",
        show_envvar=True,
        help="Use only grafts signed by a key in this directory (its *.pub files); others are refused.",
    ),
]
PromptFormatOpt = Annotated[
    str,
    typer.Option(
        "--prompt-format",
        help="plain: the demo's Q:/A:/Answer: format; chat: the model's chat template, answers in \\boxed{}.",
    ),
]
SystemPromptOpt = Annotated[
    str | None,
    typer.Option("--system-prompt", help="With --prompt-format chat: the system message ('' for none)."),
]
AnswerInstructionOpt = Annotated[
    str | None,
    typer.Option(
        "--answer-instruction",
        help="With --prompt-format chat: what follows each problem (default: put the final answer in \\boxed{}).",
    ),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads",
        envvar=reproducibility.THREADS_ENV,
        show_envvar=True,
        min=1,
        max=reproducibility.MAX_THREADS,
        help="torch threads (default: $OMP_NUM_THREADS, else half the available CPUs, at most "
        f"{reproducibility.MAX_DEFAULT_THREADS}: {reproducibility.default_threads()} here). A graft made with "
        "another count is used at its own count.",
    ),
]


def apply_threads(threads: int | None) -> int:
    """Pin torch to a command's thread count, before its model loads or computes.

    Args:
        threads: `--threads` (typer already read $KVGRAFT_THREADS into it), or None for kvgraft's default.

    Returns:
        The count in force.
    """
    count = reproducibility.requested_threads(threads)
    reproducibility.set_threads(count)
    return count
