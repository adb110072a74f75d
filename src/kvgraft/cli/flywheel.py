"""The flywheel commands: harvest verified solutions into a store, bench the ladder on it, the demo of both, and
`replicate`, the published protocol in one command."""

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
    AnswerInstructionOpt,
    CpusPerWorkerOpt,
    DeviceOpt,
    JsonOpt,
    ModelOpt,
    PromptFormatOpt,
    RayAddressOpt,
    SharedCacheOpt,
    StoreOpt,
    SystemPromptOpt,
    ThreadsOpt,
    TrustedKeysOpt,
    WorkersOpt,
    apply_threads,
)
from kvgraft.cli.output import emit, out, progress, progress_with_tokens
from kvgraft.engine.engine import Engine
from kvgraft.models.loading import resolve_device

if TYPE_CHECKING:
    from kvgraft.flywheel.bench import BenchSummary
    from kvgraft.flywheel.prompting import PromptSpec

DatasetOpt = Annotated[
    str, typer.Option("--dataset", "-d", help="demo, aime2025, aime2024, amc2023, math500, or a JSONL path.")
]
SamplesOpt = Annotated[
    int,
    typer.Option(
        "--samples",
        min=1,
        help="Answers per problem on every rung (MathArena protocol: mean accuracy, 95% interval, pass@k); "
        "above 1 needs --bench-temperature above 0.",
    ),
]
BenchTemperatureOpt = Annotated[
    float | None,
    typer.Option(
        "--bench-temperature",
        min=0.0,
        help="The ladder's sampling temperature (default: 0, greedy; 0.6 with --samples above 1).",
    ),
]
CodeOpt = Annotated[
    bool,
    typer.Option("--code/--no-code", help="The code rung: the model writes a program, run in the sandbox."),
]


def _bench_temperature(samples: int, temperature: float | None) -> float:
    """The ladder's temperature: as given, else greedy for one sample and 0.6 (MathArena's usual) for several."""
    if temperature is not None:
        return temperature
    return 0.6 if samples > 1 else 0.0


def harvest(
    dataset: DatasetOpt = "demo",
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
    prompt_format: PromptFormatOpt = "plain",
    system_prompt: SystemPromptOpt = None,
    answer_instruction: AnswerInstructionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Solve, verify, store: replay grafts of verified solutions (and context blocks), with their upstream cost."""
    apply_threads(threads)  # Ray actors get the same count (EngineSpec)
    from kvgraft.core.errors import BadInputError
    from kvgraft.flywheel.datasets import load_dataset
    from kvgraft.flywheel.distributed import EngineSpec, RaySettings, WorkerPool
    from kvgraft.flywheel.harvest import HarvestSummary, build_blocks, import_solutions
    from kvgraft.flywheel.harvest import harvest as run_harvest
    from kvgraft.flywheel.prompting import PromptSpec

    if not ray and (ray_address, workers, cpus_per_worker) != (None, None, None):
        raise BadInputError("--ray-address, --workers and --cpus-per-worker go with --ray")
    settings = RaySettings.of(ray_address, workers, cpus_per_worker, device) if ray else None
    prompt = PromptSpec.of(prompt_format, system_prompt, answer_instruction)
    items = load_dataset(solutions or dataset)[:limit]
    engine = load_engine(model or "demo", store, shared_cache=shared_cache, device=device)
    prompt.bind(engine.tokenizer, engine.model_name)  # a model without a chat template fails here, before any work
    started = time.perf_counter()
    with progress_with_tokens("harvest", not as_json) as (on_chunk, on_token):
        on_item = (lambda done, total: on_chunk(done, total)) if on_chunk else None
        if settings is not None:
            with WorkerPool.open(EngineSpec.of(engine, store, shared_cache), settings, engine.fingerprint) as pool:
                if solutions is not None:
                    records = pool.import_solutions(items, on_item, check=check, prompt=prompt)
                else:
                    records = pool.harvest(
                        items, attempts, budget, temperature, on_item=on_item, check=check, prompt=prompt
                    )
        elif solutions is not None:
            records = import_solutions(engine, items, on_item, check=check, prompt=prompt)
        else:
            records = run_harvest(
                engine,
                items,
                attempts,
                budget,
                temperature,
                on_item=on_item,
                check=check,
                prompt=prompt,
                on_token=on_token,
            )
    block_ids = build_blocks(engine, records, items, check=check, prompt=prompt) if blocks else []
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
    dataset: DatasetOpt = "demo",
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
    prompt_format: PromptFormatOpt = "plain",
    system_prompt: SystemPromptOpt = None,
    answer_instruction: AnswerInstructionOpt = None,
    samples: SamplesOpt = 1,
    bench_temperature: BenchTemperatureOpt = None,
    code: CodeOpt = True,
    as_json: JsonOpt = False,
) -> None:
    """The ladder: bare, code, grafted and gated accuracy with intervals, seen vs unseen, decode tokens, receipts."""
    apply_threads(threads)
    from kvgraft.flywheel.bench import Gate, LadderOptions, run_ladder, summarize
    from kvgraft.flywheel.datasets import load_dataset
    from kvgraft.flywheel.prompting import PromptSpec
    from kvgraft.flywheel.report import write_report
    from kvgraft.flywheel.sandbox import SandboxLimits
    from kvgraft.library.library import Library
    from kvgraft.library.retrieval import make_retriever

    prompt = PromptSpec.of(prompt_format, system_prompt, answer_instruction)
    options = LadderOptions(
        budget=budget,
        gate=Gate(min_match=min_match, min_confidence=min_confidence),
        verify_receipts=verify_receipts,
        prompt=prompt,
        code=SandboxLimits() if code else None,
        samples=samples,
        temperature=_bench_temperature(samples, bench_temperature),
    )
    _check_samples(options.samples, options.temperature)
    items = load_dataset(dataset)[:limit]
    retriever = make_retriever(dense_model)  # before the model: a bad path fails at once
    engine = load_engine(model or "demo", library or store, trusted_keys=trusted_keys, device=device)
    prompt.bind(engine.tokenizer, engine.model_name)
    with progress_with_tokens("bench", not as_json) as (on_chunk, on_token):
        shelf = Library.from_store(engine.store, retriever)
        results, facts = run_ladder(engine, items, shelf, on_problem=on_chunk, options=options, on_token=on_token)
    summary = replace(
        summarize(results, budget, facts, options.gate, options=options),
        model=engine.model_name,
        dataset=dataset,
        retriever=retriever.name,
    )
    written = write_report(summary, out_dir)
    emit(as_json, written.to_json(), lambda: _print_ladder(written))


def _check_samples(samples: int, temperature: float) -> None:
    """Refuse several samples at temperature 0 before any model loads (they would all be the same answer)."""
    from kvgraft.core.errors import BadInputError

    if samples > 1 and temperature <= 0:
        raise BadInputError("--samples above 1 needs --bench-temperature above 0 (greedy answers would all agree)")


def _print_ladder(summary: BenchSummary) -> None:
    """The ladder as a table, then the receipts line."""
    from kvgraft.flywheel.report import ladder_table

    columns = ["rung", "split", "correct", "accuracy", "95% CI", "decode tokens"]
    if summary.samples > 1:
        columns[3] = f"mean accuracy ({summary.samples} samples)"
        columns.append(f"pass@{summary.samples}")
    table = Table(*columns, title=f"{summary.model} on {summary.dataset}")
    for row in ladder_table(summary):
        table.add_row(*row)
    out.print(table)
    if summary.code_outcomes:
        counted = ", ".join(f"{name} {count}" for name, count in sorted(summary.code_outcomes.items()))
        out.print(f"code rung programs: {counted}")
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


def replicate(
    model: Annotated[
        str, typer.Option("--model", "-m", help="demo, random:<arch>, or a local model directory.")
    ] = "demo",
    dataset: DatasetOpt = "aime2025",
    attempts: Annotated[int, typer.Option("--attempts", "-k", min=1, help="Harvest attempts per problem.")] = 4,
    budget: Annotated[
        int,
        typer.Option("--budget", min=1, help="Max new tokens per answer (cut to the model's window when longer)."),
    ] = 32768,
    temperature: Annotated[float, typer.Option(min=0.0, help="The harvest's sampling temperature.")] = 0.7,
    samples: SamplesOpt = 1,
    bench_temperature: BenchTemperatureOpt = None,
    code: CodeOpt = True,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N problems.")] = None,
    prompt_format: Annotated[
        str,
        typer.Option(
            "--prompt-format", help="auto (chat when the model has a chat template, else plain), plain or chat."
        ),
    ] = "auto",
    system_prompt: SystemPromptOpt = None,
    answer_instruction: AnswerInstructionOpt = None,
    store: Annotated[
        str | None, typer.Option("--store", "-s", help="Where the harvested grafts go (default: <out>/store).")
    ] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Report directory.")] = Path("kvgraft-replicate"),
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
) -> None:
    """The published protocol in one command: harvest every problem (k attempts, verified solutions stored), then the
    four-rung ladder (bare, code, grafted, gated) on all of them, seen and unseen, with upstream cost, decode
    tokens, energy where it can be read, plots, and every receipt verified."""
    apply_threads(threads)
    from kvgraft.flywheel.cycle import FlywheelPlan, run_flywheel
    from kvgraft.flywheel.datasets import load_dataset

    bench_t = _bench_temperature(samples, bench_temperature)
    _check_samples(samples, bench_t)
    count = len(load_dataset(dataset)[:limit])  # a bad dataset fails before the model loads
    engine = load_engine(model, store or str(out_dir / "store"), device=device)
    prompt = _replicate_prompt(engine, prompt_format, system_prompt, answer_instruction)
    plan = FlywheelPlan(
        model=model,
        dataset=dataset,
        harvest_count=count,
        bench_count=count,
        attempts=attempts,
        budget=budget,
        temperature=temperature,
        code=code,
        samples=samples,
        bench_temperature=bench_t,
        prompt=prompt,
    )
    with progress("replicate", not as_json) as on_chunk:
        on_progress = (lambda stage, done, total: on_chunk(done, total)) if on_chunk else None
        summary = run_flywheel(engine, plan, out_dir, on_progress)
    emit(as_json, summary.to_json(), lambda: _print_ladder(summary))
    if not summary.receipts.all_verified:
        raise typer.Exit(1)


def _replicate_prompt(
    engine: Engine, prompt_format: str, system_prompt: str | None, answer_instruction: str | None
) -> PromptSpec:
    """The prompt spec of `replicate`: `auto` is chat when the tokenizer has a chat template, else plain."""
    from kvgraft.flywheel.prompting import PromptSpec

    if prompt_format == "auto":
        has_template = bool(getattr(engine.tokenizer, "chat_template", None))
        prompt_format = "chat" if has_template else "plain"
    prompt = PromptSpec.of(prompt_format, system_prompt, answer_instruction)
    prompt.bind(engine.tokenizer, engine.model_name)  # no chat template: one clear error, before any work
    return prompt
