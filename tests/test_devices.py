"""Devices: `--device` and `Engine.load(device=...)`, the device's default dtype, the CUDA reproducibility settings
and what the fingerprint records of them.

This machine has no GPU: the CUDA paths themselves run in benchmarks/gpu_check.py on a machine that has one. Here
the parsing, the errors, the defaults and the fingerprint entries are checked with the machine's facts passed as
arguments, the settings are applied in a child process (they are process-wide), and the CPU path is checked to
give the very bytes it gave before devices existed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner, Result

from kvgraft.cli import app
from kvgraft.core import reproducibility
from kvgraft.core.errors import BadInputError, EnvironmentMismatchError
from kvgraft.core.fingerprint import check_fingerprint, cuda_environment, numeric_environment
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.models.loading import check_device, default_dtype, load_model, parse_device, resolve_device
from kvgraft.store import LocalStore

from conftest import TEXT, EngineFactory, cached_model

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
CPU_ENVIRONMENT_KEYS = {
    "torch",
    "transformers",
    "mkl",
    "onednn",
    "cpu_capability",
    "threads",
    "mkl_cbwr",
    "mkl_dynamic",
    "omp_dynamic",
    "device",
}
"""What a CPU fingerprint's environment held before devices existed: grafts made then must stay valid."""
CUDA_KEYS = {
    "device_name",
    "cuda",
    "cudnn",
    "deterministic_algorithms",
    "cublas_workspace_config",
    "tf32_matmul",
    "tf32_cudnn",
    "cudnn_deterministic",
    "cudnn_benchmark",
    "sdpa_backends",
}
REPEATABLE = reproducibility.CudaSettings(
    deterministic_algorithms=True,
    cublas_workspace_config=":4096:8",
    tf32_matmul=False,
    tf32_cudnn=False,
    cudnn_deterministic=True,
    cudnn_benchmark=False,
    sdpa_backends=("flash", "mem_efficient", "math", "cudnn"),
)
runner = CliRunner()


# --- names ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "device"),
    [
        ("cpu", torch.device("cpu")),
        ("cuda", torch.device("cuda", 0)),
        ("cuda:0", torch.device("cuda", 0)),
        ("cuda:3", torch.device("cuda", 3)),
        (" CUDA:1 ", torch.device("cuda", 1)),
        ("mps", torch.device("mps")),
    ],
)
def test_device_names_parse(name: str, device: torch.device) -> None:
    assert parse_device(name) == device


@pytest.mark.parametrize(
    "name", ["xpu9", "", "gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "mps:1", "cuda:0:1", "auto"]
)
def test_unknown_device_is_one_clear_line(name: str) -> None:
    with pytest.raises(BadInputError) as raised:
        parse_device(name)
    assert str(raised.value) == f"unknown device {name!r}; use cpu, cuda, cuda:N or mps"


def test_devices_this_machine_lacks_are_refused_with_what_it_has() -> None:
    version = torch.__version__
    cuda0, cuda2 = torch.device("cuda", 0), torch.device("cuda", 2)

    def refusal(device: torch.device, built: bool, count: int, mps: bool) -> str:
        with pytest.raises(BadInputError) as raised:
            check_device(device, cuda_built=built, cuda_devices=count, mps_available=mps)
        return str(raised.value)

    assert (
        refusal(cuda0, False, 0, False)
        == f"CUDA is not available on this machine (torch {version}, built without CUDA)"
    )
    assert refusal(cuda0, True, 0, False) == f"CUDA is not available on this machine (torch {version}, no GPU found)"
    assert refusal(cuda2, True, 1, False) == "no device cuda:2: this machine has 1 CUDA device (cuda:0)"
    assert refusal(cuda2, True, 2, False) == "no device cuda:2: this machine has 2 CUDA devices (cuda:0 to cuda:1)"
    assert refusal(torch.device("mps"), True, 4, False) == (
        f"MPS is not available on this machine (torch {version}; MPS needs Apple silicon and macOS)"
    )
    # What the machine has is accepted (nothing raised).
    check_device(cuda2, cuda_built=True, cuda_devices=3, mps_available=False)
    check_device(torch.device("mps"), cuda_built=False, cuda_devices=0, mps_available=True)
    check_device(torch.device("cpu"), cuda_built=False, cuda_devices=0, mps_available=False)


@NO_CUDA
def test_cuda_on_this_machine_is_refused_before_anything_loads() -> None:
    why = "built without CUDA" if torch.version.cuda is None else "no GPU found"
    line = f"CUDA is not available on this machine (torch {torch.__version__}, {why})"
    for call in (lambda: resolve_device("cuda"), lambda: load_model("random:llama", device="cuda:1")):
        with pytest.raises(BadInputError) as raised:
            call()
        assert str(raised.value) == line
    assert resolve_device("cpu") == torch.device("cpu")


def test_the_default_dtype_follows_the_device() -> None:
    assert [default_dtype(d) for d in ("cpu", "cuda", "cuda:1", "mps")] == [
        "float32",
        "bfloat16",
        "bfloat16",
        "float32",
    ]
    assert default_dtype(torch.device("cuda", 0)) == "bfloat16"
    model, _ = load_model("random:llama")  # no dtype, no device: float32 on the CPU, as before
    assert (model.dtype, model.device) == (torch.float32, torch.device("cpu"))
    assert load_model("random:llama", dtype="bfloat16", device="cpu")[0].dtype == torch.bfloat16  # named: it wins


# --- the CPU path is what it was --------------------------------------------------------------------------------


def test_an_explicit_cpu_device_gives_the_same_bytes(tmp_path: Path) -> None:
    params = SamplingParams(max_new_tokens=6)
    runs = []
    for name, kwargs in (("default", {}), ("explicit", {"device": "cpu", "dtype": "float32"})):
        engine = Engine.load("random:gemma4", chunk_size=16, store=LocalStore(tmp_path / name), **kwargs)  # type: ignore[arg-type]
        put = engine.put(TEXT)
        result = engine.generate(" and so", graft_id=put.id, params=params)
        fresh = engine.run_fresh(result.receipt.input_tokens, params)
        runs.append((put.id, engine.fingerprint.digest, result.receipt.logits_chain_sha256, fresh.logits_chain))
        assert result.exact and fresh.logits_chain == result.receipt.logits_chain_sha256
    # The graft id commits to every block's bytes and to the fingerprint: equal ids are equal grafts.
    assert runs[0] == runs[1]
    fixture_model, _ = cached_model("random:gemma4")  # what the other tests (and grafts made before) used
    assert load_model("random:gemma4", device="cpu")[0].state_dict().keys() == fixture_model.state_dict().keys()


def test_kept_logits_come_back_on_the_cpu(make_engine: EngineFactory) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    result = engine.generate(" x", graft_id=put.id, params=SamplingParams(max_new_tokens=3), keep_logits=True)
    fresh = engine.run_fresh(result.receipt.input_tokens, SamplingParams(max_new_tokens=3), keep_logits=True)
    assert [t.device.type for t in result.generation.step_logits] == ["cpu"] * 3
    assert all(torch.equal(a, b) for a, b in zip(result.generation.step_logits, fresh.step_logits, strict=True))


# --- the fingerprint ------------------------------------------------------------------------------------------


def test_cpu_fingerprints_hold_what_they_held() -> None:
    assert set(numeric_environment(torch.device("cpu"))) == CPU_ENVIRONMENT_KEYS
    model, tokenizer = cached_model("random:llama")
    from kvgraft.core.fingerprint import compute_fingerprint

    assert set(compute_fingerprint(model, tokenizer, 16).environment) == CPU_ENVIRONMENT_KEYS


def test_cuda_fingerprints_record_the_repeatability_settings() -> None:
    env = cuda_environment("NVIDIA H200", "12.8", 91002, REPEATABLE)
    assert set(env) == CUDA_KEYS
    assert env == {
        "device_name": "NVIDIA H200",
        "cuda": "12.8",
        "cudnn": 91002,
        "deterministic_algorithms": True,
        "cublas_workspace_config": ":4096:8",
        "tf32_matmul": False,
        "tf32_cudnn": False,
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "sdpa_backends": ["flash", "mem_efficient", "math", "cudnn"],
    }
    assert json.loads(json.dumps(env)) == env  # goes into manifests as it is


def _on_cuda(engine: Engine) -> None:
    """The engine's fingerprint as a CUDA run of the same model records it."""
    fp = engine.fingerprint
    env = dict(fp.environment) | {"device": "cuda"} | cuda_environment("NVIDIA H200", "12.8", 91002, REPEATABLE)
    engine.__dict__["_loaded_fingerprint"] = dataclasses.replace(fp, environment=env)


def test_a_graft_made_on_another_device_is_refused_unless_allowed(make_engine: EngineFactory) -> None:
    on_gpu = make_engine()
    _on_cuda(on_gpu)
    put = on_gpu.put(TEXT)  # the graft records the CUDA environment
    stored = on_gpu.store.manifest(put.id).fingerprint
    assert stored.environment["device"] == "cuda" and stored.environment["tf32_matmul"] is False
    cpu = make_engine()
    with pytest.raises(EnvironmentMismatchError) as raised:
        cpu.generate(" x", graft_id=put.id)
    message = str(raised.value)
    assert message.startswith("numeric environment differs (graft vs this run: ")
    assert "device 'cuda' vs 'cpu'" in message and "device_name 'NVIDIA H200' vs None" in message
    assert message.endswith(
        "(the graft was made on cuda, this run is on cpu: run on cuda to use it exactly); exactness is not "
        "guaranteed under another environment"
    )
    differences = check_fingerprint(stored, cpu.fingerprint, allow_environment_mismatch=True)
    assert {d.split(" ")[0] for d in differences} == CUDA_KEYS | {"device"}
    lenient = make_engine(allow_environment_mismatch=True)
    result = lenient.generate(" x", graft_id=put.id, params=SamplingParams(max_new_tokens=2))
    assert result.exact is False and "device 'cuda' vs 'cpu'" in result.receipt.environment_differences


# --- the settings, applied in a child process (they are process-wide) ------------------------------------------


def _settings_in_child(code: str, env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


_CHILD = """
import json, os, kvgraft
from kvgraft.core import reproducibility as r
before = r.cuda_settings().to_json()
r.configure_cuda()
after = r.cuda_settings().to_json()
os.environ[r.CUBLAS_ENV] = ":16:8"  # as if the user had chosen it
r.configure_cuda()
print(json.dumps({"before": before, "after": after, "kept": r.cuda_settings().to_json()}))
"""


def test_configure_cuda_makes_the_run_repeatable_and_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if k != reproducibility.CUBLAS_ENV} | {"PYTHONPATH": str(ROOT / "src")}
    seen = _settings_in_child(_CHILD, env)
    # Importing kvgraft sets the cuBLAS workspace before anything can start CUDA; the rest waits for a CUDA device.
    assert seen["before"]["cublas_workspace_config"] == ":4096:8"
    assert seen["before"]["deterministic_algorithms"] is False
    assert seen["after"] == REPEATABLE.to_json()
    # A workspace setting the user chose is kept, and recorded.
    assert seen["kept"] == REPEATABLE.to_json() | {"cublas_workspace_config": ":16:8"}


# --- the command line --------------------------------------------------------------------------------------------


def _fails(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_every_command_takes_device_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    line = "error: unknown device 'xpu9'; use cpu, cuda, cuda:N or mps"
    commands = [
        ["build", "--text", TEXT],
        ["generate", "--prompt", "hello", "-n", "1"],
        ["verify", "--all"],
        ["harvest", "--limit", "1"],
        ["bench", "--limit", "1"],
        ["demo", "--exactness"],
        ["serve"],
    ]
    for command in commands:
        assert _fails(runner.invoke(app, [*command, "--device", "xpu9", "--store", store])) == line, command
    assert (
        _fails(runner.invoke(app, ["generate", "--prompt", "hi", "--store", store], env={"KVGRAFT_DEVICE": "xpu9"}))
        == line
    )
    assert not (tmp_path / "store").exists()  # refused before any store work


@NO_CUDA
def test_cuda_asked_on_this_machine_is_one_line(tmp_path: Path) -> None:
    why = "built without CUDA" if torch.version.cuda is None else "no GPU found"
    line = f"error: CUDA is not available on this machine (torch {torch.__version__}, {why})"
    store = str(tmp_path / "store")
    assert _fails(runner.invoke(app, ["build", "--text", TEXT, "--device", "cuda", "--store", store])) == line
    assert _fails(runner.invoke(app, ["generate", "--prompt", "hi", "--device", "cuda:1", "--store", store])) == line


def test_build_with_device_cpu_is_the_build_without_it(tmp_path: Path) -> None:
    ids = []
    for name, extra in (("a", []), ("b", ["--device", "cpu"])):
        args = ["build", "--text", TEXT, "-C", "16", "--store", str(tmp_path / name), "--json", *extra]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        ids.append(json.loads(result.stdout)["id"])
    assert ids[0] == ids[1]


# --- benchmarks/gpu_check.py ---------------------------------------------------------------------------------------


def _gpu_check(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])}
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    return subprocess.run(
        [sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


@NO_CUDA
def test_gpu_check_without_cuda_is_one_line(tmp_path: Path) -> None:
    result = _gpu_check("--out", "report.json", cwd=tmp_path)
    why = "built without CUDA" if torch.version.cuda is None else "no GPU found"
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: CUDA is not available on this machine (torch {torch.__version__}, {why}); gpu_check.py needs a "
        "CUDA GPU (--smoke runs its logic on the CPU)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_smoke_runs_every_section_on_the_cpu(tmp_path: Path) -> None:
    result = _gpu_check("--smoke", "--out", "report.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["smoke"], report["device"]) == (True, "cpu")
    assert set(report["environment"]["fingerprint_environment"]) == CPU_ENVIRONMENT_KEYS
    cases = report["exactness"]["cases"]
    assert [(c["arch"], c["dtype"]) for c in cases] == [
        (arch, dtype) for arch in ("llama", "gemma4") for dtype in ("float32", "bfloat16")
    ]
    assert all(c["exact"] and c["graft_equals_fresh"] and c["graft_verified"] for c in cases)
    assert report["exactness"]["all_exact"] is True
    rows = report["restore_vs_recompute"]["rows"]
    assert [r["tokens"] for r in rows] == [128, 256] and all(r["exact"] is True for r in rows)
    energy = report["energy"]
    assert energy["answers"] == 2 and energy["decode_tokens"] > 0
    if energy["joules"] is None:
        assert energy["joules_per_answer"] == "not measured" and energy["source"].startswith("not measured")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # temporary stores cleaned up
