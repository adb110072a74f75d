"""Harvest wall time on the demo model: one process vs Ray with 1 and 2 workers, side by side in one run.

Usage: python benchmarks/ray_harvest.py [--problems 8] [--attempts 2] [--budget 160] [--repeats 3] [--threads N]
           [--json]

The same problems, seeds and settings go through the single-process `harvest` and through two `WorkerPool`s, of
1 and of 2 actors, on a local Ray started here (this machine's CPUs, stopped at the end); each run has its own
temporary store. Both pools are started first (their start, actors importing torch and loading the model, is
reported apart: a long harvest pays it once), then each round runs all three, the order rotated from round to
round so that a busy moment of the machine does not always fall on the same run; the table shows medians.
"harvest" is the wall time from the first problem sent to the last record back.

Every actor runs with the driver's torch thread count (`--threads`, default torch's own), which is part of a
graft's fingerprint: where workers x threads exceeds the cores, the actors share them. Ray's CPU reservation per
actor is a third of the machine's CPUs so that both pools fit at once; it is bookkeeping only (an idle pool uses
no CPU). The records of every run must be equal (timings aside), or the script exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from kvgraft.engine.engine import Engine
from kvgraft.flywheel.datasets import Item, load_dataset
from kvgraft.flywheel.distributed import EngineSpec, RaySettings, WorkerPool, ray_session
from kvgraft.flywheel.harvest import HarvestRecord, harvest

TIMINGS = ("wall_s", "build_s", "graft_id")  # the graft id hashes the solve's wall time (cost.wall_s)


def _untimed(records: list[HarvestRecord]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.to_json().items() if k not in TIMINGS} for r in records]


def _timed(label: str, workers: int, run: Any) -> dict[str, Any]:
    started = time.perf_counter()
    records = run()
    return {"mode": label, "workers": workers, "harvest_s": time.perf_counter() - started, "records": records}


def _measure(items: list[Item], args: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    """Every run `--repeats` times, the order rotated each round; returns each run's rounds."""
    engines = {name: Engine.load("demo", store=f"{tmp}/{name}") for name in ("single", "one", "two")}
    runs: dict[str, list[dict[str, Any]]] = {"single": [], "one": [], "two": []}
    cpus = (os.cpu_count() or 1) / 3  # both pools fit at once; the actors' threads are the driver's regardless
    starts = {}
    with contextlib.ExitStack() as stack:
        pools = {}
        for name, workers in (("one", 1), ("two", 2)):
            engine = engines[name]
            started = time.perf_counter()
            spec = EngineSpec.of(engine, engine.store.location)
            settings = RaySettings(workers=workers, cpus_per_worker=cpus)
            pools[name] = stack.enter_context(WorkerPool.open(spec, settings, engine.fingerprint))
            starts[name] = time.perf_counter() - started
        calls = {
            "single": lambda: _timed(
                "single process", 0, lambda: harvest(engines["single"], items, args.attempts, args.budget)
            ),
            "one": lambda: _timed("ray", 1, lambda: pools["one"].harvest(items, args.attempts, args.budget)),
            "two": lambda: _timed("ray", 2, lambda: pools["two"].harvest(items, args.attempts, args.budget)),
        }
        order = ["single", "one", "two"]
        for round_ in range(args.repeats):
            for name in order[round_ % 3 :] + order[: round_ % 3]:
                runs[name].append(calls[name]())
                print(f"round {round_ + 1}: {name} {runs[name][-1]['harvest_s']:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for name in order:
        rounds = runs[name]
        rows.append(
            rounds[0]
            | {
                "start_s": starts.get(name, 0.0),
                "harvest_s": statistics.median(r["harvest_s"] for r in rounds),
                "rounds_s": [r["harvest_s"] for r in rounds],
                "same_each_round": all(_untimed(r["records"]) == _untimed(rounds[0]["records"]) for r in rounds),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--attempts", type=int, default=2)
    parser.add_argument("--budget", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, the order of the runs rotated each round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the driver and every actor")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    items = load_dataset("demo")[: args.problems]
    with ray_session(RaySettings()), tempfile.TemporaryDirectory(prefix="kvgraft-bench-") as tmp:
        rows = _measure(items, args, tmp)
    same = all(row["same_each_round"] and _untimed(row["records"]) == _untimed(rows[0]["records"]) for row in rows)
    verified = sum(r.verified for r in rows[0]["records"])
    for row in rows:
        del row["records"]
    one, two = rows[1]["harvest_s"], rows[2]["harvest_s"]
    result = {
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "problems": len(items),
        "verified": verified,
        "rows": rows,
        "one_over_two_workers": one / two,
        "single_over_two_workers": rows[0]["harvest_s"] / two,
        "same_records": same,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"demo model, {len(items)} problems ({verified} verified), {args.attempts} attempts x {args.budget} "
            f"tokens; {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads per process"
        )
        print(f"| run | workers | pool start | harvest (median of {args.repeats}) | rounds | vs single process |")
        print("|---|---:|---:|---:|---|---:|")
        for row in rows:
            speedup = rows[0]["harvest_s"] / row["harvest_s"]
            print(
                f"| {row['mode']} | {row['workers'] or '-'} | {row['start_s']:.1f} s | {row['harvest_s']:.1f} s | "
                f"{', '.join(f'{r:.1f}' for r in row['rounds_s'])} | {speedup:.2f}x |"
            )
        print(f"1 worker / 2 workers: {result['one_over_two_workers']:.2f}x; same records: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
