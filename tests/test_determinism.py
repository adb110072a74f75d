"""benchmarks/determinism.py at CI size (about 2 minutes): under CPU load, repeated builds of a text, in-process and
in fresh processes, give one graft id, and every verification is exact. The full campaign's figures are in the
README's exactness section."""

from __future__ import annotations

from pathlib import Path

from test_benchmarks import _run


def test_repeated_builds_under_load_give_one_id_and_verify_exact(tmp_path: Path) -> None:
    args = ["--models", "random:llama,random:gemma4", "--dtypes", "float32", "--threads", "2", "--texts", "1"]
    args += ["--chars", "300", "--builds", "6", "--verifies", "3", "--fresh", "2", "--load", "2"]
    data = _run("determinism.py", *args, cwd=tmp_path)
    assert data["configurations"] == 2
    assert data["builds"] == 2 * (6 + 1 + 2)
    assert data["verifications"] == 2 * (3 + 2)
    for configuration in data["configurations_detail"]:
        assert (configuration["extra_ids"], configuration["failed_verifications"]) == (0, 0), configuration
    assert (data["extra_ids"], data["failed_verifications"]) == (0, 0)
