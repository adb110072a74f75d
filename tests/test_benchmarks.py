"""The benchmark scripts at a small scale, so that they keep working (their figures are read from full runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str, cwd: Path) -> dict:  # type: ignore[type-arg]
    env = os.environ | {"PYTHONPATH": str(BENCHMARKS)}
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_effective_context_at_ci_scale(tmp_path: Path) -> None:
    data = _run("effective_context.py", "--scale", "0.001", "--queries", "10", "--dedup-grafts", "3", cwd=tmp_path)
    for key in (
        "library_tokens",
        "window",
        "effective_ratio",
        "disk_bytes",
        "rss_peak_bytes",
        "retrieval_ms",
        "restore_ms",
        "ttft_restore_over_recompute",
    ):
        assert key in data
    assert set(data["rss_peak_bytes"]) == {"1%", "10%", "100%"}
    assert data["library_tokens"] >= 2_854 and data["effective_ratio"] == data["library_tokens"] / 1024
    assert data["retrieval_hit_rate"] == 1.0
    dedup = data["dedup"]
    # Three grafts share a 1,024-token preamble: its 16 blocks are on disk once, read back by the second and third.
    assert dedup["reused_blocks"] == [0, 16, 16] and dedup["preamble_blocks"] == 16
    assert dedup["block_files"] == dedup["blocks_named"] - 2 * 16
    assert dedup["dedup_ratio"] > 2.0 and dedup["verified_exact"] is True
    assert list(tmp_path.iterdir()) == []  # the temporary libraries are cleaned up


def test_restore_vs_recompute_at_ci_scale(tmp_path: Path) -> None:
    data = _run("restore_vs_recompute.py", "--sizes", "64", "--layers", "1", "--repeats", "1", cwd=tmp_path)
    assert [row["tokens"] for row in data["rows"]] == [64]
    assert data["rows"][0]["exact"] is True


def test_serve_load_at_ci_scale(tmp_path: Path) -> None:
    data = _run("serve_load.py", "--requests", "6", "--concurrency", "3", "--max-tokens", "2", cwd=tmp_path)
    assert data["errors"] == 0 and data["model"] == "demo"
    assert list(data["modes"]) == ["bare", "grafted", "retrieved"]
    for mode in data["modes"].values():
        assert mode["ok"] == 6 and mode["requests_per_s"] > 0 and 0 < mode["p50_ms"] <= mode["p99_ms"]
    assert data["modes"]["bare"]["grafted"] == 0
    assert data["modes"]["grafted"]["grafted"] == data["modes"]["retrieved"]["grafted"] == 6
    assert data["grafted_equal_bare"]["compared"] == 6
    assert data["grafted_equal_bare"]["equal"] == 6


def test_composition_at_ci_scale(tmp_path: Path) -> None:
    data = _run("composition.py", "--archs", "llama", "--pairs", "2", "--problems", "2", cwd=tmp_path)
    row = data["random"]["llama"]
    assert row["pairs"] == 2 and 0.0 < row["kl_first_median"] <= row["kl_first_max"]
    demo = data["demo"]
    assert demo["problems"] == 2 and set(demo["correct"]) == {
        "own graft alone (exact)",
        "after another graft, exact recompute",
        "approximate",
    }
    assert demo["kl_first_max"] >= 0.0 and 0 <= demo["argmax_agree"] <= 2
    assert list(tmp_path.iterdir()) == []


def test_exactness_cost_at_ci_scale(tmp_path: Path) -> None:
    data = _run("exactness_cost.py", "--tokens", "128", "--layers", "1", "--repeats", "1", cwd=tmp_path)
    cnr, no_cnr = data["cnr"], data["no_cnr"]
    if cnr["settings"]["mkl_cbwr"] != "none":
        assert (cnr["settings"]["mkl_cbwr"], no_cnr["settings"]["mkl_cbwr"]) == ("AUTO,STRICT", "OFF")
    # A check build stores the graft a plain build stores, and computes its blocks twice.
    assert cnr["distinct_ids"] == no_cnr["distinct_ids"] == 1
    for ratio in ("check_over_plain", "cnr_over_no_cnr", "verify_over_build"):  # figures, not asserted: timings
        assert isinstance(data[ratio], float)
