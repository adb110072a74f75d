"""The flywheel run end to end, as the demo runs it: harvest part of an exam, pack blocks, bench the whole exam."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.engine.engine import Engine
from kvgraft.flywheel.bench import Gate, run_ladder, summarize
from kvgraft.flywheel.datasets import Item, load_dataset
from kvgraft.flywheel.harvest import HarvestRecord, build_blocks, harvest
from kvgraft.flywheel.report import write_report
from kvgraft.library.library import Library


@dataclass(frozen=True)
class FlywheelPlan:
    model: str = "demo"
    dataset: str = "demo"
    harvest_count: int = 15
    """the first N problems are harvested (may become seen); the rest stay unseen by construction"""
    bench_count: int | None = None
    attempts: int = 8
    budget: int = 160


QUICK = FlywheelPlan(harvest_count=6, bench_count=10, attempts=4)


def harvest_summary(records: list[HarvestRecord], blocks: list[str], wall_s: float) -> dict[str, Any]:
    return {
        "problems": len(records),
        "verified": sum(r.verified for r in records),
        "errors": sum(r.error is not None for r in records),
        "replay_grafts": [r.graft_id for r in records if r.graft_id],
        "blocks": blocks,
        "attempts": sum(r.attempts for r in records),
        "tokens_generated": sum(r.tokens_generated for r in records),
        "wall_s": wall_s,
    }


def run_flywheel(
    engine: Engine,
    plan: FlywheelPlan,
    report_dir: Path,
    on_progress: Any = None,
) -> dict[str, Any]:
    items: list[Item] = load_dataset(plan.dataset)
    if plan.bench_count is not None:
        items = items[: plan.bench_count]
    started = time.perf_counter()
    records = harvest(
        engine, items[: plan.harvest_count], plan.attempts, plan.budget, on_item=_stage(on_progress, "harvest")
    )
    blocks = build_blocks(engine, records, items)
    harvested = harvest_summary(records, blocks, time.perf_counter() - started)
    gate = Gate()
    results, facts = run_ladder(
        engine, items, Library.from_store(engine.store), plan.budget, gate, on_problem=_stage(on_progress, "bench")
    )
    summary = summarize(results, plan.budget, facts, gate) | {
        "model": engine.model_name,
        "dataset": plan.dataset,
        "harvest": harvested,
    }
    summary["upstream"]["harvest_all"] = {
        "problems_tried": harvested["problems"],
        "verified": harvested["verified"],
        "attempts": harvested["attempts"],
        "tokens_generated": harvested["tokens_generated"],
        "wall_s": harvested["wall_s"],
    }
    write_report(summary, report_dir)
    return summary


def _stage(callback: Any, name: str) -> Any:
    if callback is None:
        return None
    return lambda done, total: callback(name, done, total)
