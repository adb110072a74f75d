"""SIGKILL at random points of build, put, rm and gc, in a forked child process (the model loaded once, here).

Each trial prepares the store (a graft to remove, an absent one to build, litter for gc), forks a child that runs
one operation, kills it with SIGKILL after a random delay within the operation's measured duration, and then
checks: every listed graft reads back with every hash checked, no partial graft is visible (every entry of
grafts/ is a whole graft whose manifest names it), `gc(0)` clears the litter (tmp/ empty, no block that no graft
names), and a killed build or put, run again, gives the same graft id. CI: 30 trials; `--campaign`: 500.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from kvgraft.core.errors import KvgraftError
from kvgraft.engine.engine import Engine
from kvgraft.format.manifest import MANIFEST_NAME, parse_manifest
from kvgraft.store import LocalStore

from faultkit import Summary, forked, is_campaign, make_engine

pytestmark = pytest.mark.faults

OPS = ("build", "put", "rm", "gc")
PREFIX = "A shared opening of every text in this test, two blocks long. "
TEXTS = [PREFIX + f"Variant {i} ends its own way, with words of its own: {'xyz'[i % 3] * (i + 3)}." for i in range(6)]


def check_consistent(store: LocalStore) -> list[str]:
    """Every listed graft reads back checked, and grafts/ holds only whole grafts; returns the problems."""
    problems = []
    grafts = store.root / "grafts"
    for entry in sorted(grafts.iterdir()) if grafts.is_dir() else []:
        manifest = entry / MANIFEST_NAME
        if not entry.is_dir() or not manifest.is_file():
            problems.append(f"partial graft {entry.name}")
            continue
        try:
            if parse_manifest(manifest.read_bytes(), str(manifest)).id != entry.name:
                problems.append(f"graft {entry.name} holds another manifest")
        except KvgraftError as exc:
            problems.append(f"graft {entry.name}: {exc}")
    for graft_id in store.ids():
        try:
            store.get(graft_id)
        except KvgraftError as exc:
            problems.append(f"graft {graft_id[:12]} does not verify: {exc}")
    return problems


def check_gc_cleans(store: LocalStore) -> list[str]:
    """gc(0) leaves tmp/ empty and no unreferenced block; returns the problems."""
    store.gc(0.0)
    problems = [f"litter left in tmp/: {p.name}" for p in (store.root / "tmp").iterdir()]
    on_disk = {p.name.removesuffix(".safetensors") for p in store.block_files()}
    referenced = store.referenced_blocks()
    problems += [f"unreferenced block {k[:12]} after gc" for k in sorted(on_disk - referenced)]
    problems += [f"missing block {k[:12]}" for k in sorted(referenced - on_disk)]
    return problems


def prepare(engine: Engine, store: LocalStore, op: str, text: str, expected: dict[str, str]):  # type: ignore[no-untyped-def]
    """Set the store up for `op` on `text`; returns the work the child runs."""
    graft_id = expected[text]
    present = graft_id in store.ids()
    if op in ("build", "put") and present:
        store.delete(graft_id)
    if op == "build":
        return lambda: engine.put(text)
    if op == "put":
        built = engine.build(text)
        return lambda: store.put(built.manifest, built.tensors, built.blocks)
    if not present:
        engine.put(text)
    if op == "rm":
        return lambda: store.delete(graft_id)
    # gc: what a killed rm leaves (the graft moved under tmp/, its blocks unreferenced), for gc to clear.
    doomed = store.root / "tmp" / f"rm-litter-{graft_id[:8]}"
    doomed.mkdir(parents=True, exist_ok=True)
    (store.root / "grafts" / graft_id).rename(doomed / graft_id)
    return lambda: store.gc(0.0)


def run_killed(work, delay: float) -> str:  # type: ignore[no-untyped-def]
    """Fork `work`, SIGKILL it after `delay` s; returns "killed", "finished" or "failed" (it raised)."""
    pid = forked(work)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return {-signal.SIGKILL: "killed", 0: "finished"}.get(code, "failed")


def test_sigkill_never_leaves_half_a_graft(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    trials_n = int(os.environ.get("KVGRAFT_FAULTS_TRIALS", 500 if is_campaign(request) else 30))
    seed = int(os.environ.get("KVGRAFT_FAULTS_SEED", "1200"))
    store = LocalStore(tmp_path / "store")
    engine = make_engine(store)
    expected = {text: engine.put(text).id for text in TEXTS}  # every graft once: the ids a rebuild must give
    durations: dict[str, float] = {}
    for op in OPS:  # each operation's duration, run whole in a child: the fastest of 3, since a run slowed by other
        # work on the machine would put most kills after the operation ended
        runs = []
        for _ in range(3):
            work = prepare(engine, store, op, TEXTS[0], expected)
            pid = forked(work)
            started = time.perf_counter()  # after the fork returns, as run_killed's delay counts (forking this
            # large process takes longer than some operations)
            _, status = os.waitpid(pid, 0)
            runs.append(time.perf_counter() - started)
            assert os.waitstatus_to_exitcode(status) == 0, op
            assert not check_consistent(store) and not check_gc_cleans(store)
        durations[op] = min(runs)
    summary = Summary("crashes", seed, extra={"durations_s": {k: round(v, 3) for k, v in durations.items()}})
    for i in range(trials_n):
        rng = random.Random(seed + i)
        op, text = rng.choice(OPS), rng.choice(TEXTS)
        work = prepare(engine, store, op, text, expected)
        before = set(store.ids()) - ({expected[text]} if op == "rm" else set())
        outcome = run_killed(work, rng.uniform(0.0, durations[op] * 0.9))
        lost = before - set(store.ids())
        summary.counts["grafts_lost"] += len(lost)
        summary.counts["trials"] += 1
        summary.counts[f"{op}_{outcome}"] += 1
        problems = ([f"the child raised during {op}"] if outcome == "failed" else []) + check_consistent(store)
        problems += [f"graft lost: {graft_id[:12]}" for graft_id in sorted(lost)]
        listed = len(store.ids())
        problems += check_gc_cleans(store)
        if op in ("build", "put"):
            rebuilt = engine.put(text)
            store.get(rebuilt.id)
            if rebuilt.id != expected[text]:
                problems.append(f"rebuild gave {rebuilt.id[:12]}, expected {expected[text][:12]}")
        summary.counts["grafts_verified"] += listed
        for problem in problems:
            summary.failures.append(f"seed {seed + i} ({op} {outcome}): {problem}")
    summary.counts["partial_grafts"] = sum("partial graft" in f for f in summary.failures)
    summary.report()
    assert not summary.failures, "\n".join(summary.failures[:20])
    assert sum(v for k, v in summary.counts.items() if k.endswith("_killed")) > trials_n // 3
