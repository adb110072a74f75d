"""The prepared check for a machine with one CUDA GPU: exactness, restore vs recompute, the fingerprint's CUDA
entries and energy per answer, written to one JSON file (under 8 minutes on one H100/H200-class GPU).

Usage:
    python benchmarks/gpu_check.py [--out gpu_check.json] [--device cuda:0]
    python benchmarks/gpu_check.py --smoke [--out gpu_check.json]    # the CPU at tiny sizes: the logic, no figures

What it measures:
- `exactness`: for each of the eight random architectures in float32 and bfloat16, a graft is built, restored and
  continued (8 new tokens): its logits chain must equal a fresh run's under the schedule, and `verify_graft` must
  find every KV tensor and the next-token logits equal to a fresh recompute;
- `restore_vs_recompute`: time to first token with a graft restored from disk vs the prefix recomputed, at 4,096
  and 32,768 tokens, with Llama-3.1-8B layer shapes (hidden 4096, 32 heads, 8 KV heads of 128, FFN 14336; byte
  vocabulary, random bfloat16 weights made on the GPU), the same measurement as restore_vs_recompute.py;
- `environment`: the fingerprint's environment of a CUDA engine, and whether each repeatability setting is as
  kvgraft asks (deterministic algorithms, cuBLAS workspace, TF32 off, cuDNN deterministic and not autotuned);
- `energy`: joules per answer of the demo model (NVML's counter; "not measured" without nvidia-ml-py or a counter).

Every section runs on its own: an error in one is recorded in the JSON (`error`) and the others still run. Without
CUDA (and without --smoke) the script writes nothing and exits 1 with one line saying why.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from restore_vs_recompute import measure
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from kvgraft.core.errors import BadInputError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_graft
from kvgraft.flywheel.datasets import load_dataset
from kvgraft.flywheel.energy import EnergyMeter
from kvgraft.flywheel.problems import prompt_of
from kvgraft.models.byte_tokenizer import build_byte_tokenizer
from kvgraft.models.loading import resolve_device
from kvgraft.models.random_models import RANDOM_ARCHS
from kvgraft.store import LocalStore

from _shapes import byte_llama_config

EXACTNESS_TEXT = (
    "Grafts keep the state of a model after it has read a text, so that the text need not be read again. "
    "A restored state continues exactly as the fresh one would, byte for byte, under the fixed schedule. "
)
"""About 200 byte tokens: several whole chunks of 16 and a tail that is recomputed at use."""
EXACTNESS_PROMPT = " So it follows that"
REPEATABLE = {
    "deterministic_algorithms": True,
    "cublas_workspace_config": ":4096:8",
    "tf32_matmul": False,
    "tf32_cudnn": False,
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
}
"""The CUDA environment entries as kvgraft sets them (a $CUBLAS_WORKSPACE_CONFIG of :16:8 is deterministic too)."""


def llama_8b_like(layers: int, max_positions: int, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """Llama-3.1-8B layer shapes with a byte vocabulary; random weights drawn on `device` (fast on a GPU).

    Args:
        layers: decoder layers (the real model has 32).
        max_positions: the longest sequence the model accepts.
        dtype: the weights' dtype.
        device: where the weights are made.

    Returns:
        The model in eval mode.
    """
    config = byte_llama_config(4096, 14336, layers, 32, 8, 128, max_positions)
    return _build_on(config, dtype, device)


def tiny_llama(layers: int, max_positions: int, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The same architecture at toy sizes, for --smoke."""
    return _build_on(byte_llama_config(64, 128, layers, 4, 2, 16, max_positions), dtype, device)


def _build_on(config: LlamaConfig, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def exactness_case(device: torch.device, arch: str, dtype: str, store: Path) -> dict[str, Any]:
    """One architecture and dtype: build, restore and continue a graft, against a fresh run and a recompute.

    Returns:
        {arch, dtype, graft_equals_fresh, tokens_equal, graft_verified, exact, seconds}.
    """
    started = time.perf_counter()
    engine = Engine.load(f"random:{arch}", dtype=dtype, device=str(device), chunk_size=16, store=LocalStore(store))
    put = engine.put(EXACTNESS_TEXT)
    params = SamplingParams(max_new_tokens=8)
    grafted = engine.generate(EXACTNESS_PROMPT, graft_id=put.id, params=params)
    fresh = engine.run_fresh(grafted.receipt.input_tokens, params)
    chain_equal = grafted.receipt.logits_chain_sha256 == fresh.logits_chain
    tokens_equal = grafted.output_tokens == fresh.output_tokens
    verified = verify_graft(engine, put.id).exact
    return {
        "arch": arch,
        "dtype": dtype,
        "device": str(engine.model.device),
        "graft_tokens": put.tokens,
        "aligned_tokens": put.aligned_tokens,
        "graft_equals_fresh": chain_equal,
        "tokens_equal": tokens_equal,
        "graft_verified": verified,
        "exact": chain_equal and tokens_equal and verified and grafted.exact,
        "seconds": time.perf_counter() - started,
    }


def exactness(device: torch.device, archs: list[str], dtypes: list[str]) -> dict[str, Any]:
    """Every architecture in every dtype (a case that fails to run is recorded with its error, not raised)."""
    cases = []
    with tempfile.TemporaryDirectory(prefix="kvgraft-gpu-check-") as tmp:
        for arch in archs:
            for dtype in dtypes:
                store = Path(tmp) / f"{arch}-{dtype}"
                case = functools.partial(exactness_case, device, arch, dtype, store)
                cases.append(_guarded(case, {"arch": arch, "dtype": dtype}))
                _progress(f"exactness {arch} {dtype}: {'exact' if cases[-1].get('exact') else 'NOT EXACT'}")
    return {"cases": cases, "all_exact": all(case.get("exact") is True for case in cases), "count": len(cases)}


def _measure_store_get(engine: Engine, n: int) -> dict[str, Any]:
    """restore_vs_recompute.py's row for the store's own restore path, one repeat."""
    return dict(measure(engine, n, 1, ["store_get"])[0])


def restore_vs_recompute(
    device: torch.device, build: Callable[..., PreTrainedModel], sizes: list[int], layers: int, chunk_size: int
) -> dict[str, Any]:
    """Time to first token restored vs recomputed at each size (restore_vs_recompute.py's `measure`, 1 repeat)."""
    model = build(layers, max(sizes) + 256, torch.bfloat16, device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvgraft-gpu-check-", dir=".") as tmp:
        engine = Engine(model, build_byte_tokenizer(), "bench:llama-8b-like", chunk_size, LocalStore(Path(tmp)))
        for n in sizes:
            rows.append(_guarded(functools.partial(_measure_store_get, engine, n), {"tokens": n}))
            _progress(f"restore vs recompute {n} tokens: {rows[-1].get('speedup_warm', 'error')}")
    del model
    return {"layers": layers, "dtype": "bfloat16", "chunk_size": chunk_size, "rows": rows}


def environment(device: torch.device, model: str) -> dict[str, Any]:
    """The fingerprint's environment of an engine on `device`, and whether the CUDA settings are kvgraft's."""
    with tempfile.TemporaryDirectory(prefix="kvgraft-gpu-check-") as tmp:
        engine = Engine.load(model, device=str(device), store=LocalStore(Path(tmp)))
        env = engine.fingerprint.environment
    checks = {key: env.get(key) == value for key, value in REPEATABLE.items()} if device.type == "cuda" else {}
    return {"fingerprint_environment": env, "settings_as_asked": checks, "all_as_asked": all(checks.values())}


def energy(device: torch.device, model: str, answers: int, budget: int) -> dict[str, Any]:
    """Joules per answer of `model` on the first `answers` demo problems, greedy, up to `budget` new tokens."""
    with tempfile.TemporaryDirectory(prefix="kvgraft-gpu-check-") as tmp:
        engine = Engine.load(model, device=str(device), store=LocalStore(Path(tmp)))
        items = load_dataset("demo")[:answers]
        params = SamplingParams(max_new_tokens=budget, stop=("\n",))
        engine.generate(prompt_of(items[0].problem), params=SamplingParams(max_new_tokens=2))  # warm-up
        meter = EnergyMeter(str(device))
        meter.start()
        started = time.perf_counter()
        tokens = sum(len(engine.generate(prompt_of(item.problem), params=params).output_tokens) for item in items)
        seconds = time.perf_counter() - started
        reading = meter.stop()
    joules = reading.joules
    return {
        "model": model,
        "answers": len(items),
        "decode_tokens": tokens,
        "seconds": seconds,
        "source": reading.source,
        "joules": joules,
        "joules_per_answer": joules / len(items) if joules is not None else "not measured",
        "joules_per_token": joules / tokens if joules is not None and tokens else "not measured",
    }


def _guarded(run: Callable[[], dict[str, Any]], label: dict[str, Any]) -> dict[str, Any]:
    """Run one part; an exception becomes {**label, "error": its last line, "traceback": ...} in the report."""
    try:
        return run()
    except Exception as exc:  # one failing part must not lose the figures of the others
        lines = str(exc).strip().splitlines()
        return {**label, "error": f"{type(exc).__name__}: {lines[-1] if lines else ''}", "traceback": _tail()}


def _tail() -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-12:])


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _section(report: dict[str, Any], name: str, run: Callable[[], dict[str, Any]]) -> None:
    started = time.perf_counter()
    report[name] = _guarded(run, {})
    report[name]["section_seconds"] = time.perf_counter() - started
    _progress(f"{name} done in {report[name]['section_seconds']:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N (--smoke: cpu)")
    parser.add_argument("--smoke", action="store_true", help="the CPU at tiny sizes: checks the script, not the GPU")
    parser.add_argument("--layers", type=int, default=None, help="restore vs recompute: layers (default 32; smoke 1)")
    parser.add_argument("--sizes", default=None, help="restore vs recompute: prefix tokens (default 4096,32768)")
    args = parser.parse_args()
    try:
        device = resolve_device("cpu" if args.smoke else args.device)
    except BadInputError as exc:
        print(f"error: {exc}; gpu_check.py needs a CUDA GPU (--smoke runs its logic on the CPU)", file=sys.stderr)
        return 1
    if device.type != "cuda" and not args.smoke:
        print(f"error: gpu_check.py needs a CUDA device, got {device}", file=sys.stderr)
        return 1
    smoke = args.smoke
    sizes = [int(s) for s in (args.sizes or ("128,256" if smoke else "4096,32768")).split(",")]
    layers = args.layers or (1 if smoke else 32)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "smoke": smoke,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    archs = ["llama", "gemma4"] if smoke else list(RANDOM_ARCHS)
    _section(report, "environment", lambda: environment(device, "random:llama"))
    _section(report, "exactness", lambda: exactness(device, archs, ["float32", "bfloat16"]))
    build = tiny_llama if smoke else llama_8b_like
    chunk = 64 if smoke else 256
    _section(report, "restore_vs_recompute", lambda: restore_vs_recompute(device, build, sizes, layers, chunk))
    model = "random:llama" if smoke else "demo"
    _section(report, "energy", lambda: energy(device, model, 2 if smoke else 10, 16 if smoke else 160))
    report["seconds"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    _progress(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
