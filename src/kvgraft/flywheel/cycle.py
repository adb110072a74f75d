"""The flywheel run end to end, as the demo runs it: harvest part of an exam, pack blocks, bench the whole exam."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvgraft.engine.engine import Engine
from kvgraft.flywheel.bench import BenchSummary, Gate, run_ladder, summarize
from kvgraft.flywheel.datasets import Item, load_dataset
from kvgraft.flywheel.harvest import HarvestSummary, build_blocks, harvest
from kvgraft.flywheel.report import write_report
from kvgraft.library.library import Library

ProgressCallback = Callable[[str, int, int], None]
"""called with (stage, done, total) for the stages harvest and bench"""


@dataclass(frozen=True, kw_only=True)
class FlywheelPlan:
    """What a flywheel run does."""

    model: str = "demo"
    dataset: str = "demo"
    harvest_count: int = 15
    """the first N problems are harvested (may become seen); the rest stay unseen by construction"""
    bench_count: int | None = None
    """bench only the first N problems (None: all of them)"""
    attempts: int = 8
    budget: int = 160


QUICK = FlywheelPlan(harvest_count=6, bench_count=10, attempts=4)


def run_flywheel(
    engine: Engine, plan: FlywheelPlan, report_dir: Path, on_progress: ProgressCallback | None = None
) -> BenchSummary:
    """Harvest the plan's first problems into the engine's store, pack blocks, then bench all the problems.

    Args:
        engine: the model and the store the library is built in.
        plan: what to harvest and bench.
        report_dir: where the report is written (results.json, report.md, plots).
        on_progress: progress callback.

    Returns:
        The bench summary, labelled with the model, the dataset, the harvest and the report's path.
    """
    items: list[Item] = load_dataset(plan.dataset)
    if plan.bench_count is not None:
        items = items[: plan.bench_count]
    started = time.perf_counter()
    records = harvest(
        engine, items[: plan.harvest_count], plan.attempts, plan.budget, on_item=_stage(on_progress, "harvest")
    )
    blocks = build_blocks(engine, records, items)
    harvested = HarvestSummary.of(records, blocks, time.perf_counter() - started)
    gate = Gate()
    results, facts = run_ladder(
        engine, items, Library.from_store(engine.store), plan.budget, gate, on_problem=_stage(on_progress, "bench")
    )
    summary = replace(
        summarize(results, plan.budget, facts, gate, {r.problem_id: r.wall_s for r in records}),
        model=engine.model_name,
        dataset=plan.dataset,
        harvest=harvested,
    )
    return write_report(summary, report_dir)


def _stage(callback: ProgressCallback | None, name: str) -> Callable[[int, int], None] | None:
    if callback is None:
        return None
    return lambda done, total: callback(name, done, total)
