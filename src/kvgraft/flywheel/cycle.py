"""The flywheel run end to end, as the demo runs it: harvest part of an exam, pack blocks, bench the whole exam."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvgraft.engine.engine import Engine
from kvgraft.flywheel.bench import BenchSummary, Gate, LadderOptions, run_ladder, summarize
from kvgraft.flywheel.datasets import Item, load_dataset
from kvgraft.flywheel.harvest import HarvestSummary, build_blocks, harvest
from kvgraft.flywheel.prompting import PromptSpec
from kvgraft.flywheel.report import write_report
from kvgraft.flywheel.sandbox import SandboxLimits
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
    temperature: float = 0.7
    """the harvest's sampling temperature"""
    code: bool = True
    """run the code rung (programs in the sandbox)"""
    samples: int = 1
    """answers per problem on every rung of the ladder"""
    bench_temperature: float = 0.0
    """the ladder's temperature (above 0 when `samples` > 1)"""
    prompt: PromptSpec = field(default_factory=PromptSpec)
    seed: int = 0
    """the harvest's first seed"""


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
        engine,
        items[: plan.harvest_count],
        plan.attempts,
        plan.budget,
        plan.temperature,
        plan.seed,
        on_item=_stage(on_progress, "harvest"),
        prompt=plan.prompt,
    )
    blocks = build_blocks(engine, records, items, prompt=plan.prompt)
    harvested = HarvestSummary.of(records, blocks, time.perf_counter() - started)
    gate = Gate()
    options = LadderOptions(
        budget=plan.budget,
        gate=gate,
        prompt=plan.prompt,
        code=SandboxLimits() if plan.code else None,
        samples=plan.samples,
        temperature=plan.bench_temperature,
    )
    library = Library.from_store(engine.store)
    results, facts = run_ladder(engine, items, library, on_problem=_stage(on_progress, "bench"), options=options)
    solve_walls = {r.problem_id: r.wall_s for r in records}
    summary = replace(
        summarize(results, plan.budget, facts, gate, solve_walls, options),
        model=engine.model_name,
        dataset=plan.dataset,
        harvest=harvested,
    )
    return write_report(summary, report_dir)


def _stage(callback: ProgressCallback | None, name: str) -> Callable[[int, int], None] | None:
    if callback is None:
        return None
    return lambda done, total: callback(name, done, total)
