"""The `kvgraft` command line: a thin layer over `kvgraft.engine.engine`. Only this module prints or exits."""

from __future__ import annotations

import functools
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, ParamSpec

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvgraft.core.errors import BadInputError, KvgraftError
from kvgraft.core.sampling import SamplingParams
from kvgraft.core.schedule import DEFAULT_CHUNK_SIZE, ChunkCallback
from kvgraft.engine.engine import Engine
from kvgraft.format.receipt import parse_receipt
from kvgraft.store import open_store

P = ParamSpec("P")

app = typer.Typer(
    name="kvgraft",
    help="Byte-exact KV-cache grafts: build, store, restore, generate and verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)

FALLBACK_MODEL = "random:gemma4"
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="random:<arch>[:<seed>], a local HF model directory, or a hub id. "
        "Defaults to the graft's own model, else random:gemma4.",
    ),
]
StoreOpt = Annotated[
    str | None, typer.Option("--store", "-s", help="Store directory (default: $KVGRAFT_STORE or ./.kvgraft).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
ChunkOpt = Annotated[
    int | None,
    typer.Option(
        "--chunk-size", "-C", help=f"Chunk size C of the schedule (default: the graft's, else {DEFAULT_CHUNK_SIZE})."
    ),
]
DtypeOpt = Annotated[
    str | None, typer.Option("--dtype", help="float32, bfloat16 or float16 (default: the graft's, else float32).")
]
EnvOpt = Annotated[
    bool,
    typer.Option(
        "--allow-env-mismatch", help="Use grafts made under another numeric environment; results say 'not exact'."
    ),
]


def main() -> None:
    app()


def command(name: str | None = None) -> Callable[[Callable[P, None]], Callable[P, None]]:
    """`app.command`, with domain errors turned into one red line and exit code 1, never a traceback."""

    def register(func: Callable[P, None]) -> Callable[P, None]:
        @functools.wraps(func)
        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            try:
                func(*args, **kwargs)
            except KvgraftError as exc:
                err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
                raise typer.Exit(1) from None

        app.command(name)(run)
        return run

    return register


def _emit(as_json: bool, data: Any, render: Callable[[], None]) -> None:
    if as_json:
        typer.echo(json.dumps(data))
    else:
        render()


@contextmanager
def _progress(label: str, enabled: bool) -> Iterator[ChunkCallback | None]:
    """A progress bar on stderr for long work (off for --json and when stderr is not a terminal)."""
    if not enabled or not err.is_terminal:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


def _engine(
    model: str | None,
    store: str | None,
    chunk_size: int | None = None,
    dtype: str | None = None,
    graft: str | None = None,
    allow_env_mismatch: bool = False,
) -> Engine:
    """Load the engine; unspecified model, dtype and chunk size default to the graft's own when there is one."""
    graft_store = open_store(store)
    if graft is not None and (model is None or chunk_size is None or dtype is None):
        manifest = graft_store.manifest(graft)
        model = model or manifest.model_name
        chunk_size = chunk_size or manifest.chunk_size
        dtype = dtype or manifest.dtype
    return Engine.load(
        model or FALLBACK_MODEL,
        dtype=dtype or "float32",
        chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
        store=graft_store,
        allow_environment_mismatch=allow_env_mismatch,
    )


def _read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInputError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"cannot read {path}: {exc}") from None


def _jsonl_items(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(text, metadata) per line: a JSON string, or an object with "text" (other fields become metadata)."""
    items: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(_read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if isinstance(row, str):
            items.append((row, {}))
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            items.append((row["text"], {k: v for k, v in row.items() if k != "text"}))
        else:
            raise BadInputError(f'{path}:{number}: expected a JSON string or an object with a "text" field')
    if not items:
        raise BadInputError(f"{path}: no texts in file")
    return items


@command()
def build(
    text: Annotated[str | None, typer.Option("--text", "-t", help="The text to graft.")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="A UTF-8 text file to graft.")] = None,
    jsonl: Annotated[
        Path | None, typer.Option("--jsonl", help='A JSONL file: one graft per line ("text" field).')
    ] = None,
    title: Annotated[str | None, typer.Option("--title", help="Metadata title for a single graft.")] = None,
    after: Annotated[
        str | None,
        typer.Option("--after", help="Continue this graft: the new one holds its tokens, then the text (one chain)."),
    ] = None,
    model: ModelOpt = None,
    store: StoreOpt = None,
    chunk_size: ChunkOpt = None,
    dtype: DtypeOpt = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Compute each new block twice; store nothing unless both agree in every bit (2x compute)."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Build grafts from text and put them in the store (leading blocks already stored are reused, not computed)."""
    sources = [s for s in (text, file, jsonl) if s is not None]
    if len(sources) != 1:
        raise BadInputError("give exactly one of --text, --file or --jsonl")
    engine = _engine(model, store, chunk_size, dtype, after)
    if jsonl is not None:
        items = _jsonl_items(jsonl)
    else:
        body = text if text is not None else _read_text_file(file)  # type: ignore[arg-type]
        items = [(body, {"title": title} if title else {})]
    for number, (body, _) in enumerate(items, start=1):
        try:
            engine.check_text(body)  # all texts are checked before any graft is stored
        except BadInputError as exc:
            raise BadInputError(f"{jsonl}:{number}: {exc}" if jsonl is not None else str(exc)) from None
    results = []
    with _progress("building", not as_json) as on_chunk:
        for body, metadata in items:
            results.append(engine.put(body, metadata, on_chunk, after=after, check=check).to_json())
    payload: Any = results if jsonl is not None else results[0]

    def render() -> None:
        table = Table("id", "tokens", "aligned", "blocks (reused)", "bytes")
        for r in results:
            blocks = f"{r['blocks']} ({r['reused_blocks']})"
            table.add_row(r["id"][:16], str(r["tokens"]), str(r["aligned_tokens"]), blocks, f"{r['bytes']:,}")
        out.print(table)

    _emit(as_json, payload, render)


@command("ls")
def list_grafts(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """List the grafts in the store."""
    graft_store = open_store(store)
    rows: list[dict[str, Any]] = []
    for graft_id in graft_store.ids():
        manifest = graft_store.manifest(graft_id)
        rows.append(
            {
                "id": graft_id,
                "tokens": len(manifest.tokens),
                "aligned_tokens": manifest.aligned_tokens,
                "model": manifest.model_name,
                "dtype": manifest.dtype,
                "title": manifest.metadata.get("title"),
                "created_at": manifest.created_at,
            }
        )

    def render() -> None:
        table = Table("id", "tokens", "aligned", "model", "dtype", "title", "created")
        for r in rows:
            table.add_row(
                r["id"][:16],
                str(r["tokens"]),
                str(r["aligned_tokens"]),
                r["model"],
                r["dtype"],
                r["title"] or "",
                r["created_at"],
            )
        out.print(table if rows else f"no grafts in {graft_store.root}")

    _emit(as_json, {"store": str(graft_store.root), "grafts": rows}, render)


@command()
def inspect(
    graft: Annotated[str, typer.Argument(help="Graft id or unique prefix.")],
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a graft's manifest and where its tensors file is."""
    graft_store = open_store(store)
    manifest = graft_store.manifest(graft)
    data = manifest.to_json() | {"tensors_path": graft_store.tensors_path(manifest.id)}

    def render() -> None:
        shown = {k: v for k, v in data.items() if k != "tokens"} | {"tokens": f"[{len(manifest.tokens)} ids]"}
        out.print_json(json.dumps(shown))

    _emit(as_json, data, render)


@command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue (after the graft's text).")] = "",
    graft: Annotated[
        list[str] | None,
        typer.Option(
            "--graft",
            "-g",
            help="Graft id or prefix to restore first. Repeat it to compose grafts in order: exact when they form "
            "one chain (see build --after), else refused unless --approximate.",
        ),
    ] = None,
    approximate: Annotated[
        bool,
        typer.Option("--approximate", help="Compose grafts that are not one chain by re-positioning them (not exact)."),
    ] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1)] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 means greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the sampler (temperature > 0).")] = 0,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    receipt: Annotated[Path | None, typer.Option("--receipt", help="Write the receipt JSON here.")] = None,
    model: ModelOpt = None,
    store: StoreOpt = None,
    chunk_size: ChunkOpt = None,
    dtype: DtypeOpt = None,
    allow_env_mismatch: EnvOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Generate a continuation, optionally from a restored graft, with a receipt."""
    grafts = list(graft or [])
    engine = _engine(model, store, chunk_size, dtype, grafts[0] if grafts else None, allow_env_mismatch)
    params = SamplingParams(max_new_tokens, temperature, top_p, seed, tuple(stop or ()))
    with _progress("prefill", not as_json) as on_chunk:
        result = engine.generate(prompt, None, params, on_chunk=on_chunk, graft_ids=grafts, approximate=approximate)
    if receipt is not None:
        try:
            result.receipt.write(receipt)
        except OSError as exc:
            raise BadInputError(f"cannot write receipt to {receipt}: {exc.strerror}") from None

    def render() -> None:
        out.print(result.text, highlight=False, markup=False)
        t = result.timings
        if result.approximate:
            exact = "NO, APPROXIMATE composition (re-positioned grafts)"
        else:
            exact = "yes" if result.exact else "NOT EXACT: " + "; ".join(result.receipt.environment_differences)
        err.print(
            f"[dim]{len(result.output_tokens)} tokens, ttft {t['ttft_s'] * 1000:.1f} ms, "
            f"{t['decode_tokens_per_s']:.0f} tok/s, exact: {exact}, receipt {result.receipt.id[:16]}[/]"
        )

    _emit(as_json, result.to_json(), render)


@command()
def verify(
    graft: Annotated[str | None, typer.Argument(help="Graft id or prefix to recompute and compare.")] = None,
    receipt: Annotated[
        Path | None, typer.Option("--receipt", help="A receipt JSON to rerun fresh and compare.")
    ] = None,
    every: Annotated[
        bool, typer.Option("--all", help="Check every graft in the store (or --sample N of them), one by one.")
    ] = False,
    sample: Annotated[
        int | None, typer.Option("--sample", min=1, help="With --all: only N grafts, drawn at random (--seed).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="With --sample: which random sample.")] = 0,
    model: ModelOpt = None,
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check a graft against a fresh recompute, or a receipt against a fresh rerun. Exit 0 only when exact."""
    from kvgraft.engine.verify import verify_graft, verify_receipt

    if sum((graft is not None, receipt is not None, every)) != 1:
        raise BadInputError("give a graft id, --receipt FILE or --all (one of them)")
    if sample is not None and not every:
        raise BadInputError("--sample goes with --all")
    if every:
        _verify_store(model, store, sample, seed, as_json)
        return
    if receipt is not None:
        parsed = parse_receipt(_read_text_file(receipt), str(receipt))
        engine = Engine.load(
            model or parsed.model_name,
            dtype=parsed.fingerprint.model["dtype"],
            chunk_size=int(parsed.fingerprint.schedule["chunk_size"]),
            store=open_store(store),
        )
        with _progress("rerun", not as_json) as on_chunk:
            result: Any = verify_receipt(engine, parsed, on_chunk)
        failed = [
            name for name, ok in (("output tokens", result.tokens_equal), ("logits", result.logits_equal)) if not ok
        ]
        if parsed.approximate:
            failed.append("kind (an approximate composition of re-positioned grafts is never exact)")
    else:
        assert graft is not None
        engine = _engine(model, store, graft=graft)
        with _progress("recompute", not as_json) as on_chunk:
            result = verify_graft(engine, graft, on_chunk)
        failed = [name for name, ok in (("KV tensors", result.kv_equal), ("logits", result.logits_equal)) if not ok]
        if result.mismatched:
            failed[0] += " (" + ", ".join(result.mismatched[:6]) + ("..." if len(result.mismatched) > 6 else "") + ")"
    if result.environment_differences:
        failed.append("environment (" + "; ".join(result.environment_differences) + ")")
    data = result.to_json()

    def render() -> None:
        table = Table("check", "result")
        for key, value in data.items():
            table.add_row(key, str(value))
        out.print(table)

    _emit(as_json, data, render)
    if failed:
        err.print(f"[bold red]not exact:[/] differs in {', '.join(failed)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _verify_store(model: str | None, store: str | None, sample: int | None, seed: int, as_json: bool) -> None:
    """`verify --all`: every graft (or a sample), one engine per model, dtype and chunk size."""
    from kvgraft.engine.verify import choose_grafts, verify_grafts

    graft_store = open_store(store)
    chosen = choose_grafts(graft_store.ids(), sample, seed)
    engines: dict[tuple[str, str, int], Engine] = {}

    def engine_for(manifest: Any) -> Engine:
        key = (model or manifest.model_name, manifest.dtype, manifest.chunk_size)
        if key not in engines:
            engines[key] = Engine.load(key[0], dtype=key[1], chunk_size=key[2], store=graft_store)
        return engines[key]

    with _progress("verify", not as_json) as on_graft:
        result = verify_grafts(engine_for, graft_store, chosen, on_graft)
    data = result.to_json()

    def render() -> None:
        out.print(
            f"{len(result.checked)} of {result.store_grafts} grafts checked: {len(result.checked) - len(result.failed)}"
            f" exact, {len(result.failed)} not exact, {len(result.skipped)} could not be checked"
        )
        for failure in result.failed:
            where = ", ".join(failure.mismatched[:4]) or ("logits" if not failure.logits_equal else "environment")
            out.print(f"  not exact: {failure.graft_id[:16]} ({where})", highlight=False)
        for graft_id, why in result.skipped.items():
            out.print(f"  not checked: {graft_id[:16]} ({escape(why)})", highlight=False)

    _emit(as_json, data, render)
    if not result.exact:
        raise typer.Exit(1)


@command()
def rm(
    graft: Annotated[list[str], typer.Argument(help="Graft ids or prefixes.")],
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete grafts from the store."""
    graft_store = open_store(store)
    full = [graft_store.resolve(g) for g in graft]
    for graft_id in full:
        graft_store.delete(graft_id)
    _emit(as_json, {"removed": full}, lambda: out.print("\n".join(f"removed {g}" for g in full)))


@command()
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
    as_json: JsonOpt = False,
) -> None:
    """Solve, verify, store: replay grafts of verified solutions (and context blocks), with their upstream cost."""
    from kvgraft.flywheel.cycle import harvest_summary
    from kvgraft.flywheel.datasets import load_dataset
    from kvgraft.flywheel.harvest import build_blocks, import_solutions
    from kvgraft.flywheel.harvest import harvest as run_harvest

    items = load_dataset(solutions or dataset)[:limit]
    engine = _engine(model or "demo", store)
    started = time.perf_counter()
    with _progress("harvest", not as_json) as on_chunk:
        on_item = (lambda done, total: on_chunk(done, total)) if on_chunk else None
        if solutions is not None:
            records = import_solutions(engine, items, on_item, check=check)
        else:
            records = run_harvest(engine, items, attempts, budget, temperature, on_item=on_item, check=check)
    block_ids = build_blocks(engine, records, items, check=check) if blocks else []
    summary = harvest_summary(records, block_ids, time.perf_counter() - started)
    summary["records"] = [r.to_json() for r in records]

    def render() -> None:
        out.print(
            f"{summary['verified']}/{summary['problems']} problems verified and stored as replay grafts"
            + (f" ({summary['errors']} could not be tried: see --json)" if summary["errors"] else "")
            + "; "
            f"{len(block_ids)} context block(s); {summary['tokens_generated']} tokens generated in "
            f"{summary['attempts']} attempts, {summary['wall_s']:.1f} s; store {engine.store.location}"
        )

    _emit(as_json, summary, render)


@command()
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
    as_json: JsonOpt = False,
) -> None:
    """The ladder: bare, grafted and gated accuracy with intervals, seen vs unseen, decode tokens, receipts."""
    from kvgraft.flywheel.bench import Gate, run_ladder, summarize
    from kvgraft.flywheel.datasets import load_dataset
    from kvgraft.flywheel.report import write_report
    from kvgraft.library.library import Library
    from kvgraft.library.retrieval import make_retriever

    items = load_dataset(dataset)[:limit]
    retriever = make_retriever(dense_model)  # before the model: a bad path fails at once
    engine = _engine(model or "demo", library or store)
    gate = Gate(min_match, min_confidence)
    with _progress("bench", not as_json) as on_chunk:
        results, facts = run_ladder(
            engine, items, Library.from_store(engine.store, retriever), budget, gate, verify_receipts, on_chunk
        )
    summary = summarize(results, budget, facts, gate) | {
        "model": engine.model_name,
        "dataset": dataset,
        "retriever": retriever.name,
    }
    write_report(summary, out_dir)
    _emit(as_json, summary, lambda: _print_ladder(summary))


store_app = typer.Typer(help="The store as a whole.", no_args_is_help=True)
app.add_typer(store_app, name="store")


@store_app.command("stats")
def store_stats_command(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """Grafts, tokens, bytes on disk and the dedup ratio of the store (from its persistent index)."""
    from kvgraft.library.index import store_stats

    try:
        stats = store_stats(open_store(store))
    except KvgraftError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    data = stats.to_json()

    def render() -> None:
        table = Table("measure", "value")
        for key, value in data.items():
            table.add_row(key, f"{value:,.2f}" if isinstance(value, float) else f"{value:,}")
        out.print(table)

    _emit(as_json, data, render)


@store_app.command("gc")
def store_gc_command(
    store: StoreOpt = None,
    grace: Annotated[
        float, typer.Option("--grace", help="Keep unreferenced blocks younger than this many seconds.")
    ] = 3600.0,
    as_json: JsonOpt = False,
) -> None:
    """Remove KV blocks that no graft names any more (left by an interrupted build)."""
    try:
        removed, freed = open_store(store).gc(grace)
    except KvgraftError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    data = {"removed_blocks": removed, "freed_bytes": freed}
    _emit(as_json, data, lambda: out.print(f"removed {removed:,} unreferenced blocks, {freed:,} bytes"))


def _print_ladder(summary: dict[str, Any]) -> None:
    from kvgraft.flywheel.report import ladder_table

    table = Table(
        "rung",
        "split",
        "correct",
        "accuracy",
        "95% CI",
        "decode tokens",
        title=f"{summary['model']} on {summary['dataset']}",
    )
    for row in ladder_table(summary):
        table.add_row(*row)
    out.print(table)
    receipts = summary["receipts"]
    out.print(f"receipts: {receipts['verified']}/{receipts['total']} verified; report: {summary['report']}")


@command()
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
        str | None, typer.Option("--store", "-s", help="Keep the demo's grafts here (default: a temporary store).")
    ] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Report directory.")] = Path("kvgraft-report"),
    as_json: JsonOpt = False,
) -> None:
    """The flywheel on the demo model: harvest half the exam, then the ladder (bare, grafted, gated) on all of it."""
    with tempfile.TemporaryDirectory(prefix="kvgraft-demo-") as tmp:
        if exactness:
            _exactness_demo(Path(store or tmp), store is None, as_json)
            return
        from kvgraft.flywheel.cycle import QUICK, FlywheelPlan, run_flywheel

        engine = Engine.load("demo", store=store or tmp)
        with _progress("demo", not as_json) as on_chunk:
            on_progress = (lambda stage, done, total: on_chunk(done, total)) if on_chunk else None
            summary = run_flywheel(engine, QUICK if quick else FlywheelPlan(), out_dir, on_progress)
    _emit(as_json, summary, lambda: _print_ladder(summary))
    receipts = summary["receipts"]
    if receipts["verified"] != receipts["total"]:
        raise typer.Exit(1)


def _exactness_demo(store: Path, temporary: bool, as_json: bool) -> None:
    from kvgraft.flywheel.demo import run_demo

    with _progress("building graft", not as_json) as on_chunk:
        report = run_demo(store, on_chunk=on_chunk)
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

    _emit(as_json, data, render)
    if not report.exact:
        raise typer.Exit(1)


@command()
def serve(
    model: ModelOpt = None,
    store: StoreOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="KVGRAFT_API_KEY",
            show_envvar=True,
            help="Bearer token that library writes need (without one, writes are refused).",
        ),
    ] = None,
    protect_reads: Annotated[
        bool, typer.Option("--protect-reads", help="Require the API key on every /v1 endpoint, reads included.")
    ] = False,
    max_queue: Annotated[int, typer.Option(min=1, help="Requests that may wait for the model; more get 429.")] = 16,
    max_tokens: Annotated[int, typer.Option(min=1, help="The largest max_tokens a request may ask for.")] = 512,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="The largest request body; larger get 413.")] = 1 << 20,
    cache_bytes: Annotated[
        int | None, typer.Option(min=0, help="Keep restored grafts in an LRU of this many bytes of RAM.")
    ] = None,
    dense_model: Annotated[
        str | None,
        typer.Option("--dense-model", help="Retrieve with this local sentence-transformers directory (default: BM25)."),
    ] = None,
    chunk_size: ChunkOpt = None,
    dtype: DtypeOpt = None,
    allow_env_mismatch: EnvOpt = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, grafting per request (see the README's Server section)."""
    import uvicorn

    from kvgraft.library.retrieval import make_retriever
    from kvgraft.server import ServerConfig, create_app

    config = ServerConfig(
        api_key=api_key or None,
        protect_reads=protect_reads,
        max_queue=max_queue,
        max_tokens_limit=max_tokens,
        default_completion_tokens=min(16, max_tokens),
        max_body_bytes=max_body_bytes,
    )
    config.check()  # before the model loads: a bad flag fails at once
    retriever = make_retriever(dense_model)
    engine = Engine.load(
        model or FALLBACK_MODEL,
        dtype=dtype or "float32",
        chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
        store=open_store(store),
        allow_environment_mismatch=allow_env_mismatch,
        cache_bytes=cache_bytes,
    )
    uvicorn.run(create_app(engine, config, retriever), host=host, port=port, log_level=log_level)


if __name__ == "__main__":
    main()
