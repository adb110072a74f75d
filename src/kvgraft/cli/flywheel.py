"""The flywheel commands: harvest verified solutions into a store, bench the ladder on it, and the demo of both."""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kvgraft.cli.engines import load_engine
from kvgraft.cli.options import (
    CpusPerWorkerOpt,
    DeviceOpt,
    JsonOpt,
    ModelOpt,
    RayAddressOpt,
    SharedCacheOpt,
    StoreOpt,
    ThreadsOpt,
    TrustedKeysOpt,
    WorkersOpt,
    apply_threads,
)
from kvgraft.cli.output import emit, out, progress
from kvgraft.engine.engine import Engine
from kvgraft.models.loading import resolve_device

if TYPE_CHECKING:
    from kvgraft.flywheel.bench import BenchSummary


def harvest(
    dataset: Annotated[
        str, typer.Option("--dataset", "-d", help="demo, aime2025, aime2024, amc2023, math500, or a JSONL path.")
    ] = "demo",
    solutions: Annotated[
        str | None,
        typer.Option(
            "--solutions",
            help="Import worked solutions instead of solving: a JSONL file with problem, answer and solution "
            "fields, or a bundled set that has them (aime2024, math500). Each is checked against its answer first.",
        ),
    ] = None,
    attempts: Annotated[int, typer.Option("--attempts", "-k", min=1, help="Sampled attempts per problem.")] = 4,
    budget: Annotated[int, typer.Option("--budget", min=1, help="Max new tokens per attempt.")] = 160,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.7,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N problems.")] = None,
    blocks: Annotated[
        bool, typer.Option("--blocks/--no-blocks", help="Also pack verified solutions into context blocks.")
    ] = True,
    check: Annotated[
        bool,
        typer.Option("--check/--no-check", help="Compute each stored graft's blocks twice and refuse on a difference."),
    ] = True,
    model: ModelOpt = None,
    store: StoreOpt = None,
    shared_cache: SharedCacheOpt = None,
    ray: Annotated[
        bool,
        typer.Option("--ray", help="Spread the problems over Ray actors, one model each (same grafts as without)."),
    ] = False,
    ray_address: RayAddressOpt = None,
    workers: WorkersOpt = None,
    cpus_per_worker: CpusPerWorkerOpt = None,
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """Solve, verify, store: replay grafts of verified solutions (and context blocks), with their upstream cost."""
    apply_threads(threads)  # Ray actors get the same count (EngineSpec)
    from kvgraft.core.errors import BadInputError
    from kvgraft.flywheel.datasets import load_dataset
    from kvgraft.flywheel.distributed import EngineSpec, RaySettings, WorkerPool
    from kvgraft.flywheel.harvest import HarvestSummary, build_blocks, import_solutions
    from kvgraft.flywheel.harvest import harvest as run_harvest

    if not ray and (ray_address, workers, cpus_per_worker) != (None, None, None):
        raise BadInputError("--ray-address, --workers and --cpus-per-worker go with --ray")
    settings = RaySettings.of(ray_address, workers, cpus_per_worker) if ray else None
    items = load_dataset(solutions or dataset)[:limit]
    engine = load_engine(model or "demo", store, shared_cache=shared_cache, device=device)
    started = time.perf_counter()
    with progress("harvest", not as_json) as on_chunk:
        on_item = (lambda done, total: on_chunk(done, total)) if on_chunk else None
        if settings is not None:
            with WorkerPool.open(EngineSpec.of(engine, store, shared_cache), settings, engine.fingerprint) as pool:
                if solutions is not None:
                    records = pool.import_solutions(items, on_item, check=check)
                else:
                    records = pool.harvest(items, attempts, budget, temperature, on_item=on_item, check=check)
        elif solutions is not None:
            records = import_solutions(engine, items, on_item, check=check)
        else:
            records = run_harvest(engine, items, attempts, budget, temperature, on_item=on_item, check=check)
    block_ids = build_blocks(engine, records, items, check=check) if blocks else []
    summary = HarvestSummary.of(records, block_ids, time.perf_counter() - started).to_json()
    summary["records"] = [r.to_json() for r in records]

    def render() -> None:
        out.print(
            f"{summary['verified']}/{summary['problems']} problems verified and stored as replay grafts"
            + (f" ({summary['errors']} could not be tried: see --json)" if summary["errors"] else "")
            + "; "
            f"{len(block_ids)} context block(s); {summary['tokens_generated']} tokens generated in "
            f"{summary['attempts']} attempts, {summary['wall_s']:.1f} s; store {engine.store.location}"
        )

    emit(as_json, summary, render)


def bench(
    dataset: Annotated[
        str, typer.Option("--dataset", "-d", help="demo, aime2025, aime2024, amc2023, math500, or a JSONL path.")
    ] = "demo",
    library: Annotated[
        str | None, typer.Option("--library", "-l", help="Store holding the library (default: --store).")
    ] = None,
    budget: Annotated[int, typer.Option("--budget", min=1, help="Max new tokens per answer.")] = 160,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N problems.")] = None,
    min_match: Annotated[float, typer.Option(help="Gate: minimum retrieval score.")] = 0.9,
    min_confidence: Annotated[float, typer.Option(help="Gate: minimum answer confidence.")] = 0.5,
    dense_model: Annotated[
        str | None,
        typer.Option(
            "--dense-model",
            help="Retrieve blocks with this local sentence-transformers model directory (default: BM25).",
        ),
    ] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Report directory.")] = Path("kvgraft-report"),
    verify_receipts: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Rerun every grafted answer fresh.")
    ] = True,
    model: ModelOpt = None,
    store: StoreOpt = None,
    trusted_keys: TrustedKeysOpt = None,
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """The ladder: bare, grafted and gated accuracy with intervals, seen vs unseen, decode tokens, receipts."""
    apply_threads(threads)
    from kvgraft.flywheel.bench import Gate, run_ladder, summarize
    from kvgraft.flywheel.datasets import load_dataset
    from kvgraft.flywheel.report import write_report
    from kvgraft.library.library import Library
    from kvgraft.library.retrieval import make_retriever

    items = load_dataset(dataset)[:limit]
    retriever = make_retriever(dense_model)  # before the model: a bad path fails at once
    engine = load_engine(model or "demo", library or store, trusted_keys=trusted_keys, device=device)
    gate = Gate(min_match=min_match, min_confidence=min_confidence)
    with progress("bench", not as_json) as on_chunk:
        results, facts = run_ladder(
            engine, items, Library.from_store(engine.store, retriever), budget, gate, verify_receipts, on_chunk
        )
    summary = replace(
        summarize(results, budget, facts, gate), model=engine.model_name, dataset=dataset, retriever=retriever.name
    )
    written = write_report(summary, out_dir)
    emit(as_json, written.to_json(), lambda: _print_ladder(written))


def _print_ladder(summary: BenchSummary) -> None:
    """The ladder as a table, then the receipts line."""
    from kvgraft.flywheel.report import ladder_table

    table = Table(
        "rung",
        "split",
        "correct",
        "accuracy",
        "95% CI",
        "decode tokens",
        title=f"{summary.model} on {summary.dataset}",
    )
    for row in ladder_table(summary):
        table.add_row(*row)
    out.print(table)
    receipts = summary.receipts
    out.print(f"receipts: {receipts.verified}/{receipts.total} verified; report: {summary.report}")


def demo(
    quick: Annotated[
        bool, typer.Option("--quick", help="A smaller run (10 problems, under 2 minutes), as the tests run it.")
    ] = False,
    exactness: Annotated[
        bool,
        typer.Option(
            "--exactness",
            help="Only the exactness demo: one graft on random:gemma4, restored and proven equal to a fresh run.",
        ),
    ] = False,
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            "-s",
            help="Keep the demo's grafts here (default: <out>/store; --exactness alone: a temporary store).",
        ),
    ] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Report directory.")] = Path("kvgraft-report"),
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """The flywheel on the demo model: harvest half the exam, then the ladder (bare, grafted, gated) on all of it."""
    apply_threads(threads)
    device = str(resolve_device(device))  # checked once, before any work
    if exactness:
        with tempfile.TemporaryDirectory(prefix="kvgraft-demo-") as tmp:
            _exactness_demo(Path(store or tmp), store is None, as_json, device)
        return
    from kvgraft.flywheel.cycle import QUICK, FlywheelPlan, run_flywheel

    # Kept beside the report, so that its grafts and receipts can be re-checked after the run.
    engine = Engine.load("demo", store=store or str(out_dir / "store"), device=device)
    with progress("demo", not as_json) as on_chunk:
        on_progress = (lambda stage, done, total: on_chunk(done, total)) if on_chunk else None
        summary = run_flywheel(engine, QUICK if quick else FlywheelPlan(), out_dir, on_progress)
    emit(as_json, summary.to_json(), lambda: _print_ladder(summary))
    if not summary.receipts.all_verified:
        raise typer.Exit(1)


def _exactness_demo(store: Path, temporary: bool, as_json: bool, device: str = "cpu") -> None:
    """`demo --exactness`: one graft restored and proven equal to a fresh run; exit 1 unless exact."""
    from kvgraft.flywheel.demo import run_demo

    with progress("building graft", not as_json) as on_chunk:
        report = run_demo(store, on_chunk=on_chunk, device=device)
    data = report.to_json()

    def render() -> None:
        table = Table(title=f"kvgraft exactness demo on {report.model}", show_header=True)
        table.add_column("measure")
        table.add_column("value", justify="right")
        table.add_row("graft tokens (stored KV / all)", f"{report.aligned_tokens} / {report.graft_tokens}")
        table.add_row("graft size on disk", f"{report.graft_bytes:,} bytes")
        table.add_row("prompt tokens, new tokens", f"{report.prompt_tokens}, {report.new_tokens}")
        table.add_row("time to first token, graft restored", f"{report.ttft_restored_s * 1000:.1f} ms")
        table.add_row("time to first token, recomputed", f"{report.ttft_recomputed_s * 1000:.1f} ms")
        table.add_row("graft KV + logits equal to fresh recompute", "yes" if report.graft_verified else "NO")
        table.add_row("grafted run equal to fresh run (receipt)", "yes" if report.receipt_verified else "NO")
        table.add_row("exact", "[green]yes[/]" if report.exact else "[red]NO[/]")
        out.print(table)
        if temporary:
            out.print("[dim]The demo used a temporary store; pass --store DIR to keep the graft.[/]")

    emit(as_json, data, render)
    if not report.exact:
        raise typer.Exit(1)
