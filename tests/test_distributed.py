"""Harvest and build on a local Ray (`ray.init(num_cpus=2)`, real actor processes): the results of one process,
compared by their very graft ids (a graft's metadata holds nothing that depends on timing or on the worker).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core.errors import KvgraftError
from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_graft
from kvgraft.flywheel.datasets import Item, load_dataset
from kvgraft.flywheel.distributed import EngineSpec, RaySettings, WorkerPool
from kvgraft.flywheel.harvest import HarvestRecord, build_blocks, harvest, import_solutions
from kvgraft.format.metadata import SolutionSource
from kvgraft.store import GraftStore, open_store

ray = pytest.importorskip("ray")

ITEMS = 4  # the demo model verifies the 4th problem on its first try: one replay graft, one block
SOLVE = {"attempts": 1, "budget": 160}
TIMINGS = ("wall_s", "build_s")
runner = CliRunner()


@dataclass(frozen=True)
class Baseline:
    """The single-process harvest of the first ITEMS demo problems, and the import of their solutions."""

    items: list[Item]
    records: list[HarvestRecord]
    blocks: list[str]
    imported: list[str | None]
    store: GraftStore


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # "local": a new Ray of its own, never one that `ray start` left running on this machine
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=200 * 1024 * 1024,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    engine = Engine.load("demo", store=str(tmp_path_factory.mktemp("single") / "store"))
    items = load_dataset("demo")[:ITEMS]
    records = harvest(engine, items, **SOLVE)
    imported = [r.graft_id for r in import_solutions(engine, items)]
    return Baseline(items, records, build_blocks(engine, records, items), imported, engine.store)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The driver's engine on the store the pool's actors write to."""
    return Engine.load("demo", store=str(tmp_path_factory.mktemp("ray") / "store"))


@pytest.fixture(scope="class")
def pool(local_ray: None, driver: Engine) -> Iterator[WorkerPool]:
    """Two actors for the tests of one class (they hold both CPUs of the local Ray until the class is done)."""
    spec = EngineSpec.of(driver, str(driver.store.location))
    with WorkerPool.open(spec, RaySettings(workers=2), driver.fingerprint) as opened:
        yield opened


def untimed(records: list[HarvestRecord]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.to_json().items() if k not in TIMINGS} for r in records]


def assert_same_harvest(base: Baseline, records: list[HarvestRecord], store: GraftStore) -> None:
    """Same records (timings aside) and the same replay graft ids, every one stored."""
    assert untimed(records) == untimed(base.records)  # graft ids included
    assert any(r.verified for r in records)  # the comparison covers a stored graft
    assert {r.graft_id for r in records if r.graft_id} <= set(store.ids())


def assert_no_partial_graft(engine: Engine) -> None:
    """Every graft directory is a whole graft (manifest and tensors), and every graft recomputes exactly."""
    root = Path(engine.store.location) / "grafts"
    assert sorted(p.name for p in root.iterdir()) == engine.store.ids()
    for graft in engine.store.ids():
        assert verify_graft(engine, graft).exact, graft


def test_actors_under_another_thread_count_are_refused(local_ray: None, driver: Engine) -> None:
    spec = EngineSpec.of(driver, str(driver.store.location))
    other = spec.threads % 2 + 1  # 1 <-> 2
    opened = WorkerPool.open(replace(spec, threads=other), RaySettings(workers=1), driver.fingerprint)
    with pytest.raises(KvgraftError) as caught, opened:
        pass
    assert str(caught.value).startswith(
        f"Ray worker 0 computes under another fingerprint than this process (environment.threads {spec.threads!r} "
        f"vs {other!r})"
    )


def test_actors_on_cuda_ask_ray_for_a_gpu_each(local_ray: None, driver: Engine) -> None:
    assert RaySettings.of(None, 2, None, device="cuda:1").gpus_per_worker == 1.0
    assert RaySettings.of(None, 2, None).gpus_per_worker == 0.0
    spec = EngineSpec.of(driver, str(driver.store.location))
    opened = WorkerPool.open(spec, RaySettings(workers=1, cpus_per_worker=0.01, gpus_per_worker=64), driver.fingerprint)
    with pytest.raises(KvgraftError) as caught, opened:
        pass
    assert str(caught.value).startswith("1 Ray workers of 64 GPU(s) need 64 GPUs; the cluster has ")


class TestPool:
    """Two actors on the driver's store, shared by these tests."""

    def test_harvest_on_two_actors_equals_the_single_process_harvest(
        self, pool: WorkerPool, driver: Engine, baseline: Baseline
    ) -> None:
        seen: list[tuple[int, int]] = []
        records = pool.harvest(baseline.items, **SOLVE, on_item=lambda done, total: seen.append((done, total)))
        assert seen == [(n, ITEMS) for n in range(1, ITEMS + 1)]
        assert_same_harvest(baseline, records, driver.store)
        assert build_blocks(driver, records, baseline.items) == baseline.blocks
        # The very ids: the actors ran with the driver's thread count (part of the id).
        assert [r.graft_id for r in pool.import_solutions(baseline.items)] == baseline.imported
        assert all(baseline.imported)
        assert len(set(pool.pids())) == 2

    def test_an_actor_killed_mid_harvest_is_restarted_and_its_problem_retried(
        self, pool: WorkerPool, driver: Engine, baseline: Baseline
    ) -> None:
        before = pool.pids()
        killed: list[int] = []

        def kill_first_worker(done: int, total: int) -> None:
            if not killed:  # one problem is back, others are in flight or about to be sent to this actor
                os.kill(before[0], signal.SIGKILL)
                killed.append(before[0])

        records = pool.harvest(baseline.items, **SOLVE, on_item=kill_first_worker)
        after = pool.pids()
        assert killed == [before[0]] and after[0] != before[0] and after[1] == before[1]
        assert_same_harvest(baseline, records, driver.store)
        assert {r.graft_id for r in records if r.graft_id} <= set(driver.store.ids())
        assert_no_partial_graft(driver)


# --- the command line --------------------------------------------------------------------------------------------


def cli(*args: Any) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def ok_json(result: Result) -> Any:
    assert result.exception is None, f"{result.exception!r}\nstderr: {result.stderr}"
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def fails(result: Result) -> str:
    """Exit 1 and one `error:` line on stderr, nothing else; returns the line."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_cli_harvest_with_ray_prints_the_single_process_ids(
    local_ray: None, baseline: Baseline, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    args = ("--limit", ITEMS, "--attempts", SOLVE["attempts"], "--budget", SOLVE["budget"], "--model", "demo")
    data = ok_json(cli("harvest", *args, "--store", store, "--ray", "--workers", 2, "--json"))
    records = [HarvestRecord(**(r | {"source": SolutionSource(r["source"])})) for r in data["records"]]
    stored = open_store(str(store))
    assert_same_harvest(baseline, records, stored)
    assert data["blocks"] == baseline.blocks
    assert data["replay_grafts"] == [r.graft_id for r in records if r.graft_id]
    assert sorted([*data["replay_grafts"], *data["blocks"]]) == stored.ids()


def test_cli_build_jsonl_with_ray_gives_the_sequential_ids(local_ray: None, tmp_path: Path) -> None:
    preamble = "Shared preamble of every text in this library, long enough to fill whole chunks. " * 2
    texts = [preamble + f"Text number {n} goes its own way from here, {'and on ' * n}to its end." for n in range(6)]
    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "title": f"t{n}"}) + "\n" for n, t in enumerate(texts)))
    common = ("build", "--jsonl", jsonl, "--model", "random:llama", "--chunk-size", 16, "--json")
    sequential = ok_json(cli(*common, "--store", tmp_path / "a"))
    parallel = ok_json(cli(*common, "--store", tmp_path / "b", "--ray", "--workers", 2, "--cpus-per-worker", 1))
    assert [r["id"] for r in parallel] == [r["id"] for r in sequential]
    assert len({r["id"] for r in sequential}) == len(texts)
    assert sequential[1]["reused_blocks"] > 0  # the texts do share leading blocks
    assert [(r["tokens"], r["blocks"]) for r in parallel] == [(r["tokens"], r["blocks"]) for r in sequential]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_cli_ray_errors_are_one_line(local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    port = _closed_port()
    line = fails(cli("harvest", "--limit", 1, "--store", store, "--ray", "--ray-address", f"127.0.0.1:{port}"))
    assert line == (f"error: cannot reach the Ray cluster at 127.0.0.1:{port} (Connection refused; waited at most 5 s)")
    line = fails(cli("build", "--text", "some text", "--store", store, "--workers", 2))
    assert line == "error: --ray-address, --workers and --cpus-per-worker go with --ray"
    line = fails(cli("harvest", "--limit", 1, "--store", store, "--ray", "--workers", 3))
    assert line == (
        "error: 3 Ray workers of 1 CPU(s) need 3 CPUs; the cluster has 2: ask for fewer workers or fewer CPUs per "
        "worker"
    )
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where Ray is not installed
    line = fails(cli("build", "--text", "some text", "--store", store, "--ray"))
    assert line == "error: Ray is not installed; install it with: pip install 'kvgraft[ray]'"
    assert not (store / "grafts").exists() or not any((store / "grafts").iterdir())
