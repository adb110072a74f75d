"""Commands on single grafts: build, ls, inspect, generate, verify and rm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from kvgraft.cli.engines import load_engine, open_trusted_store
from kvgraft.cli.inputs import jsonl_items, read_text_file
from kvgraft.cli.options import (
    ChunkOpt,
    CpusPerWorkerOpt,
    DeviceOpt,
    DtypeOpt,
    EnvOpt,
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
from kvgraft.cli.output import emit, err, out, progress
from kvgraft.core.errors import BadInputError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.format.manifest import Manifest
from kvgraft.format.receipt import parse_receipt
from kvgraft.format.signature import read_signing_key
from kvgraft.models.loading import resolve_device
from kvgraft.store import open_store
from kvgraft.store.base import scan_manifests
from kvgraft.store.trust import sign_graft

if TYPE_CHECKING:
    from kvgraft.engine.verify import GraftVerification, ReceiptVerification


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
    allow_env_mismatch: EnvOpt = False,
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    shared_cache: SharedCacheOpt = None,
    ray: Annotated[
        bool, typer.Option("--ray", help="Build the texts on Ray actors, one model each (same grafts as without).")
    ] = False,
    ray_address: RayAddressOpt = None,
    workers: WorkersOpt = None,
    cpus_per_worker: CpusPerWorkerOpt = None,
    sign_key: Annotated[
        Path | None, typer.Option("--sign-key", help="Sign each graft built with this private key (see `keys new`).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Build grafts from text and put them in the store (leading blocks already stored are reused, not computed)."""
    signing_key = read_signing_key(sign_key) if sign_key is not None else None  # a bad key fails before the work
    sources = [s for s in (text, file, jsonl) if s is not None]
    if len(sources) != 1:
        raise BadInputError("give exactly one of --text, --file or --jsonl")
    if not ray and (ray_address, workers, cpus_per_worker) != (None, None, None):
        raise BadInputError("--ray-address, --workers and --cpus-per-worker go with --ray")
    apply_threads(threads)  # a parent made with another count is continued at its own (Engine.build)
    # A parent made under another environment is continued under this one: its blocks are keyed by the other
    # fingerprint, so every block of the new graft is computed here and the new graft is exact under this run.
    engine = load_engine(
        model, store, chunk_size, dtype, after, allow_env_mismatch, shared_cache=shared_cache, device=device
    )
    if jsonl is not None:
        items = jsonl_items(jsonl)
    else:
        body = text if text is not None else read_text_file(file)  # type: ignore[arg-type]
        items = [(body, {"title": title} if title else {})]
    for number, (body, _) in enumerate(items, start=1):
        try:
            engine.check_text(body)  # all texts are checked before any graft is stored
        except BadInputError as exc:
            raise BadInputError(f"{jsonl}:{number}: {exc}" if jsonl is not None else str(exc)) from None
    results = []
    with progress("building", not as_json) as on_chunk:
        if ray:
            from kvgraft.flywheel.distributed import EngineSpec, RaySettings, WorkerPool

            spec = EngineSpec.of(engine, store, shared_cache, allow_env_mismatch)
            settings = RaySettings.of(ray_address, workers, cpus_per_worker)
            with WorkerPool.open(spec, settings, engine.fingerprint) as pool:
                results = pool.put(items, after=after, check=check, on_item=on_chunk)
        else:
            for body, metadata in items:
                results.append(engine.put(body, metadata, on_chunk, after=after, check=check).to_json())
    if signing_key is not None:
        for r in results:
            r["signed_by"] = sign_graft(engine.store, r["id"], signing_key).key_id
    payload: Any = results if jsonl is not None else results[0]

    def render() -> None:
        table = Table("id", "tokens", "aligned", "blocks (reused)", "bytes")
        for r in results:
            blocks = f"{r['blocks']} ({r['reused_blocks']})"
            table.add_row(r["id"][:16], str(r["tokens"]), str(r["aligned_tokens"]), blocks, f"{r['bytes']:,}")
        out.print(table)

    emit(as_json, payload, render)


def graft_row(graft_id: str, manifest: Manifest) -> dict[str, Any]:
    """A graft's summary row, as `ls --json` lists it.

    Args:
        graft_id: the graft's id in the store.
        manifest: its manifest.

    Returns:
        id, tokens, aligned_tokens, model, dtype, title (None without one) and created_at.
    """
    return {
        "id": graft_id,
        "tokens": len(manifest.tokens),
        "aligned_tokens": manifest.aligned_tokens,
        "model": manifest.model_name,
        "dtype": manifest.dtype,
        "title": manifest.metadata.get("title"),
        "created_at": manifest.created_at,
    }


def list_grafts(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """List the grafts in the store; a graft whose manifest is damaged is listed as such, with the error."""
    graft_store = open_store(store, must_exist=True)
    scan = scan_manifests(graft_store)
    rows = [graft_row(graft_id, manifest) for graft_id, manifest in scan.manifests.items()]
    damaged = [{"id": graft_id, "error": error} for graft_id, error in scan.damaged.items()]

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
        for d in damaged:
            table.add_row(d["id"][:16], "", "", "[red]damaged[/red]", "", d["error"], "")
        out.print(table if rows or damaged else f"no grafts in {graft_store.location}")
        if damaged:
            out.print(f"{len(damaged)} damaged: `kvgraft rm ID` removes one; building its text again replaces it")

    emit(as_json, {"store": graft_store.location, "grafts": rows, "damaged": damaged}, render)


def inspect(
    graft: Annotated[str, typer.Argument(help="Graft id or unique prefix.")],
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a graft's manifest and where its tensors file is."""
    graft_store = open_store(store, must_exist=True)
    manifest = graft_store.manifest(graft)
    data = manifest.to_json() | {"tensors_path": graft_store.tensors_path(manifest.id)}

    def render() -> None:
        shown = {k: v for k, v in data.items() if k != "tokens"} | {"tokens": f"[{len(manifest.tokens)} ids]"}
        out.print_json(json.dumps(shown))

    emit(as_json, data, render)


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
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    shared_cache: SharedCacheOpt = None,
    trusted_keys: TrustedKeysOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate a continuation, optionally from a restored graft, with a receipt."""
    apply_threads(threads)  # grafts made with another count run at their own (Engine.generate)
    grafts = list(graft or [])
    first = grafts[0] if grafts else None
    engine = load_engine(
        model,
        store,
        chunk_size,
        dtype,
        first,
        allow_env_mismatch,
        shared_cache=shared_cache,
        trusted_keys=trusted_keys,
        device=device,
    )
    params = SamplingParams(max_new_tokens, temperature, top_p, seed, tuple(stop or ()))
    with progress("prefill", not as_json) as on_chunk:
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

    emit(as_json, result.to_json(), render)


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
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    trusted_keys: TrustedKeysOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check a graft against a fresh recompute, or a receipt against a fresh rerun. Exit 0 only when exact."""
    if sum((graft is not None, receipt is not None, every)) != 1:
        raise BadInputError("give a graft id, --receipt FILE or --all (one of them)")
    if sample is not None and not every:
        raise BadInputError("--sample goes with --all")
    apply_threads(threads)
    device = str(resolve_device(device))  # checked once, before any store or model work
    if every:
        _verify_store(model, store, sample, seed, as_json, trusted_keys, device)
        return
    result: GraftVerification | ReceiptVerification
    if receipt is not None:
        result, failed = _rerun_receipt(receipt, model, store, as_json, device)
    else:
        assert graft is not None
        result, failed = _recompute_graft(graft, model, store, as_json, trusted_keys, device)
    if result.environment_differences:
        failed.append("environment (" + "; ".join(result.environment_differences) + ")")
    data = result.to_json()

    def render() -> None:
        table = Table("check", "result")
        for key, value in data.items():
            table.add_row(key, str(value))
        out.print(table)

    emit(as_json, data, render)
    if failed:
        err.print(f"[bold red]not exact:[/] differs in {', '.join(failed)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _rerun_receipt(
    path: Path, model: str | None, store: str | None, as_json: bool, device: str = "cpu"
) -> tuple[ReceiptVerification, list[str]]:
    """`verify --receipt`: the rerun's result and what differs, on the receipt's own dtype and chunk size."""
    from kvgraft.engine.verify import verify_receipt

    parsed = parse_receipt(read_text_file(path), str(path))
    engine = Engine.load(
        model or parsed.model_name,
        dtype=parsed.fingerprint.model["dtype"],
        chunk_size=int(parsed.fingerprint.schedule["chunk_size"]),
        store=open_store(store),
        device=device,
    )
    with progress("rerun", not as_json) as on_chunk:
        result = verify_receipt(engine, parsed, on_chunk)
    failed = [name for name, ok in (("output tokens", result.tokens_equal), ("logits", result.logits_equal)) if not ok]
    if parsed.approximate:
        failed.append("kind (an approximate composition of re-positioned grafts is never exact)")
    return result, failed


def _recompute_graft(
    graft: str,
    model: str | None,
    store: str | None,
    as_json: bool,
    trusted_keys: str | None = None,
    device: str = "cpu",
) -> tuple[GraftVerification, list[str]]:
    """`verify GRAFT`: the recompute's result and what differs (the first mismatched tensors named)."""
    from kvgraft.engine.verify import verify_graft

    engine = load_engine(model, store, graft=graft, trusted_keys=trusted_keys, device=device)
    with progress("recompute", not as_json) as on_chunk:
        result = verify_graft(engine, graft, on_chunk)
    failed = [name for name, ok in (("KV tensors", result.kv_equal), ("logits", result.logits_equal)) if not ok]
    if result.mismatched:
        failed[0] += " (" + ", ".join(result.mismatched[:6]) + ("..." if len(result.mismatched) > 6 else "") + ")"
    return result, failed


def _verify_store(
    model: str | None,
    store: str | None,
    sample: int | None,
    seed: int,
    as_json: bool,
    trusted_keys: str | None = None,
    device: str = "cpu",
) -> None:
    """`verify --all`: every graft (or a sample; under a trust policy, every trusted one), one engine per model,
    dtype and chunk size."""
    from kvgraft.engine.verify import choose_grafts, verify_grafts

    graft_store = open_trusted_store(store, trusted_keys, must_exist=True)
    chosen = choose_grafts(graft_store.ids(), sample, seed)
    engines: dict[tuple[str, str, int], Engine] = {}

    def engine_for(manifest: Any) -> Engine:
        key = (model or manifest.model_name, manifest.dtype, manifest.chunk_size)
        if key not in engines:
            engines[key] = Engine.load(key[0], dtype=key[1], device=device, chunk_size=key[2], store=graft_store)
        return engines[key]

    with progress("verify", not as_json) as on_graft:
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

    emit(as_json, data, render)
    if not result.exact:
        raise typer.Exit(1)


def rm(
    graft: Annotated[list[str], typer.Argument(help="Graft ids or prefixes.")],
    store: StoreOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete grafts from the store."""
    graft_store = open_store(store, must_exist=True)
    full = [graft_store.resolve(g) for g in graft]
    for graft_id in full:
        graft_store.delete(graft_id)
    emit(as_json, {"removed": full}, lambda: out.print("\n".join(f"removed {g}" for g in full)))
