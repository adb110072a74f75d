"""kvgraft.core.reproducibility: the settings are in force before torch computes, recorded, and enforced."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvgraft.core import reproducibility
from kvgraft.core.errors import EnvironmentMismatchError
from kvgraft.core.fingerprint import Fingerprint, check_fingerprint

from conftest import TEXT, EngineFactory


def _python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in reproducibility.ENVIRONMENT}
    done = subprocess.run(
        [sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_importing_kvgraft_puts_the_settings_in_force() -> None:
    settings = json.loads(_python("import kvgraft, json; print(json.dumps(kvgraft.core.reproducibility.settings()))"))
    if settings["mkl_cbwr"] == "none":
        pytest.skip("this torch has no MKL")
    assert settings == {"mkl_cbwr": "AUTO,STRICT", "mkl_dynamic": False, "omp_dynamic": False}


def test_a_setting_the_user_made_is_kept_and_recorded() -> None:
    settings = json.loads(
        _python(
            "import kvgraft, json; print(json.dumps(kvgraft.core.reproducibility.settings()))", MKL_CBWR="COMPATIBLE"
        )
    )
    if settings["mkl_cbwr"] == "none":
        pytest.skip("this torch has no MKL")
    assert settings["mkl_cbwr"] == "COMPATIBLE"


def test_the_fingerprint_records_the_settings(make_engine: EngineFactory) -> None:
    environment = make_engine().fingerprint.environment
    assert {k: environment[k] for k in ("mkl_cbwr", "mkl_dynamic", "omp_dynamic")} == reproducibility.settings()


_LATE = """
import json, torch
torch.ones(4, 4) @ torch.ones(4, 4)  # MKL starts here, before kvgraft could set its CNR mode
import kvgraft
from kvgraft.engine.engine import Engine
print(json.dumps(Engine.load("random:llama").fingerprint.to_json()))
"""


def test_a_process_where_mkl_started_first_is_refused(make_engine: EngineFactory) -> None:
    late = Fingerprint.from_json(json.loads(_python(_LATE)))
    if late.environment["mkl_cbwr"] == "none":
        pytest.skip("this torch has no MKL")
    assert late.environment["mkl_cbwr"] == "OFF"
    built = make_engine(chunk_size=64).build(TEXT)
    with pytest.raises(EnvironmentMismatchError) as raised:
        check_fingerprint(built.manifest.fingerprint, late)
    assert "mkl_cbwr 'AUTO,STRICT' vs 'OFF'" in str(raised.value)
    assert "import kvgraft before torch computes anything" in str(raised.value)


_ALIGNMENT = """
import kvgraft, hashlib, torch
torch.manual_seed(0)
x, w = torch.randn(1, 256), torch.randn(256, 256)
seen = set()
for offset in range(16):  # the weight at every 4-byte offset: MKL's code path depends on it unless CNR is on
    buffer = torch.empty(w.numel() + offset)
    placed = buffer[offset:].view_as(w)
    placed.copy_(w)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        seen.add(hashlib.sha256(torch.nn.functional.linear(x, placed).numpy().tobytes()).hexdigest())
print(len(seen))
"""


def test_results_do_not_depend_on_operand_alignment_or_threads() -> None:
    assert _python(_ALIGNMENT) == "1"
