"""Time to first token with a graft restored from disk vs the prefix recomputed, and graft load throughput vs a
raw read + SHA-256 of the same bytes, side by side in one run.

Usage: python benchmarks/restore_vs_recompute.py [--sizes 512,1024,2048,4096,8192] [--layers 16] [--json]
       [--profile] [--attention sdpa,kvgraft_sdpa]

The model has Llama-3.2-1B layer shapes (fp32, byte vocabulary, random weights). For each prefix length n the
graft holds n tokens; the query adds 16 prompt tokens and asks for one new token. "Restored" time to first token
counts reading the graft from disk with every tensor hash checked, rebuilding the cache and computing the
prompt; "cold" first evicts the graft's files (its blocks) from the page cache (posix_fadvise DONTNEED), "warm"
does not.
"Recomputed" runs the whole n + 16 tokens fresh under the same chunk schedule. Both runs must produce the same
first-token logits (compared by SHA-256), so every speed-up below is for an exact result.

The load is also set against a plain single-threaded read of the same files, with and without a SHA-256 of their
bytes (warm page cache): "load / read+sha" and "load / read" (the memory limit).

`--profile` instead breaks the cold restored time to first token into its phases (medians of --repeats runs): the
store's functions are wrapped with timers for the run, so each phase is wall time in the calling thread, except
the per-block reads, which run on a pool: their sum over the pool's threads is shown, and the load's wall time.
Then one more cold restore runs under torch's profiler, which gives the operators that take the time.

`--attention sdpa,kvgraft_sdpa` measures every size under transformers' sdpa and under kvgraft's (no key/value
copies for grouped heads; the same bytes, which the last line checks), one after the other in the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvgraft.core.attention import FAST_SDPA
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.format import blocks as blocks_module
from kvgraft.format.manifest import Manifest, expected_block_shapes
from kvgraft.format.tensor_files import read_block_checked, read_tensors_checked
from kvgraft.models.byte_tokenizer import build_byte_tokenizer
from kvgraft.store import LocalStore
from kvgraft.store.base import StoredGraft

from _shapes import llama_1b_like

PROMPT = " What follows from this?"  # 24 bytes -> 24 tokens
ONE_TOKEN = SamplingParams(max_new_tokens=1)


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_read_and_hash(paths: list[Path]) -> float:
    t0 = time.perf_counter()
    for path in paths:
        hashlib.sha256(path.read_bytes()).hexdigest()
    return time.perf_counter() - t0


def _raw_read(paths: list[Path]) -> float:
    t0 = time.perf_counter()
    for path in paths:
        path.read_bytes()
    return time.perf_counter() - t0


def _graft_files(store: LocalStore, graft_id: str) -> list[Path]:
    """The graft's own tensors file and every block file it names."""
    manifest = store.manifest(graft_id)
    return [Path(store.tensors_path(graft_id))] + [store.block_path(ref.key) for ref in manifest.blocks]


def _text(n_tokens: int) -> str:
    generator = torch.Generator().manual_seed(n_tokens)
    letters = "abcdefghijklmnopqrstuvwxyz     ,.\n"
    picks = torch.randint(0, len(letters), (n_tokens - 1,), generator=generator).tolist()
    return "".join(letters[i] for i in picks)  # + BOS = n tokens


LOAD_PATHS = ("store_get", "block_by_block")
"""How a graft is loaded: `store.get` as the source has it, or the load before the one-pass read (each block
memory-mapped and hashed, then `assemble`), so that both can be timed side by side in one run."""


@contextmanager
def _load_path(name: str) -> Iterator[None]:
    """`LocalStore.get` loading by `name` (one of LOAD_PATHS) while the context is open."""
    if name == "store_get":
        yield
        return
    original = LocalStore.get

    def get(self: LocalStore, graft_id: str) -> StoredGraft:
        manifest = self.manifest(graft_id)
        return StoredGraft(manifest, _block_by_block(self, manifest))

    LocalStore.get = get  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalStore.get = original  # type: ignore[method-assign]


def _block_by_block(store: LocalStore, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The load as it was before the one-pass read: each block memory-mapped and hashed, then `assemble`."""
    tensors = read_tensors_checked(Path(store.tensors_path(manifest.id)), manifest)
    shapes = expected_block_shapes(manifest)
    refs = manifest.blocks
    blocks = [read_block_checked(store.block_path(r.key), r.key, r, shapes, manifest.dtype)[1] for r in refs]
    return blocks_module.assemble(blocks) | tensors


def measure(engine: Engine, n: int, repeats: int, loads: list[str]) -> list[dict[str, float | int | bool | str]]:
    """One row per load path: cold and warm restored TTFT (medians of `repeats`, the paths interleaved) against
    one recompute, and the warm load against a raw read of the same files, with and without SHA-256."""
    put = engine.put(_text(n))
    assert isinstance(engine.store, LocalStore)
    store, paths = engine.store, _graft_files(engine.store, put.id)
    cold: dict[str, list[float]] = {name: [] for name in loads}
    warm: dict[str, list[float]] = {name: [] for name in loads}
    results = []
    for _ in range(repeats):
        for name in loads:
            with _load_path(name):
                for path in paths:
                    _evict(path)
                result = engine.generate(PROMPT, graft_id=put.id, params=ONE_TOKEN)
                cold[name].append(result.timings["ttft_s"])
                results.append(result)
                warm[name].append(engine.generate(PROMPT, graft_id=put.id, params=ONE_TOKEN).timings["ttft_s"])
    input_ids = results[0].receipt.input_tokens
    fresh = engine.run_fresh(input_ids, ONE_TOKEN)
    recompute = fresh.ttft_s
    load_s: dict[str, list[float]] = {name: [] for name in loads}
    raws, reads = [], []
    for _ in range(repeats):  # warm page cache: this compares the CPU work of one pass against two
        for name in loads:
            with _load_path(name):
                t0 = time.perf_counter()
                store.get(put.id)
                load_s[name].append(time.perf_counter() - t0)
        raws.append(_raw_read_and_hash(paths))
        reads.append(_raw_read(paths))
    size = sum(path.stat().st_size for path in paths)
    exact = all(r.receipt.logits_chain_sha256 == fresh.logits_chain for r in results) and all(
        r.output_tokens == fresh.output_tokens for r in results
    )
    raw, read = statistics.median(raws), statistics.median(reads)
    rows: list[dict[str, float | int | bool | str]] = []
    for name in loads:
        load, c, w = statistics.median(load_s[name]), statistics.median(cold[name]), statistics.median(warm[name])
        rows.append(
            {
                "tokens": n,
                "load_path": name,
                "graft_bytes": size,
                "ttft_recompute_s": recompute,
                "ttft_restore_cold_s": c,
                "ttft_restore_warm_s": w,
                "speedup_cold": recompute / c,
                "speedup_warm": recompute / w,
                "load_verify_gb_s": size / load / 1e9,
                "raw_read_sha256_gb_s": size / raw / 1e9,
                "load_over_raw": load / raw,
                "raw_read_gb_s": size / read / 1e9,
                "load_over_read": load / read,
                "exact": exact,
                "logits_chain_sha256": fresh.logits_chain,
            }
        )
    return rows


# (module, attribute, phase): what `--profile` times. Functions a version of kvgraft lacks are skipped, so the
# same command profiles the restore before and after a change to the read path.
_PHASES = (
    ("kvgraft.store.local", "LocalStore.manifest", "manifest read"),
    ("kvgraft.engine.engine", "Engine.check_graft", "fingerprint check"),
    ("kvgraft.store.local", "read_tensors_checked", "own tensors file (logits)"),
    ("kvgraft.format.tensor_files", "_map_file", "open + mmap (blocks)"),
    ("kvgraft.format.tensor_files", "_block_checked", "header + SHA-256 (page-ins when cold)"),
    ("kvgraft.format.blocks", "assemble", "copy: assemble (torch.cat)"),
    ("kvgraft.store.local", "read_blocks_assembled", "open + read + SHA-256 into place (pool, wall)"),
    ("kvgraft.format.tensor_files", "_read_block_into", "  per-block open + read + SHA-256 (sum over threads)"),
    ("kvgraft.store.local", "LocalStore.get", "load total (store.get)"),
    ("kvgraft.engine.engine", "states_from", "cache rebuild: states_from"),
    ("kvgraft.engine.engine", "restore", "cache rebuild: DynamicCache fill"),
    ("kvgraft.engine.engine", "decode", "tail + prompt compute (first token)"),
)
_TOP = {"Engine.check_graft", "LocalStore.get", "states_from", "restore", "decode"}
"""The phases that do not overlap: TTFT minus their sum is "other" (manifest reads outside the load, tokenizing)."""


@contextmanager
def _timed(phases: dict[str, list[float]]) -> Iterator[None]:
    import importlib
    import threading

    lock = threading.Lock()
    undo: list[tuple[Any, str, Any]] = []
    for module_name, attr, phase in _PHASES:
        owner: Any = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None:
            continue

        def wrapper(*args: Any, _original: Any = original, _phase: str = phase, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                with lock:
                    phases.setdefault(_phase, []).append(time.perf_counter() - t0)

        setattr(owner, name, wrapper)
        undo.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


def profile(engine: Engine, n: int, repeats: int) -> list[tuple[str, float]]:
    """Medians over `repeats` cold restores of each phase's time (summed within one run), and of the TTFT."""
    put = engine.put(_text(n))
    assert isinstance(engine.store, LocalStore)
    paths = _graft_files(engine.store, put.id)
    engine.generate(PROMPT, graft_id=put.id, params=ONE_TOKEN)  # warm-up: imports, allocator, thread pools
    runs: list[dict[str, float]] = []
    for _ in range(repeats):
        for path in paths:
            _evict(path)
        phases: dict[str, list[float]] = {}
        with _timed(phases):
            ttft = engine.generate(PROMPT, graft_id=put.id, params=ONE_TOKEN).timings["ttft_s"]
        run = {phase: sum(times) for phase, times in phases.items()}
        top = {phase for _, attr, phase in _PHASES if attr in _TOP}
        run["other (manifest reads, tokenize, ...)"] = ttft - sum(t for p, t in run.items() if p in top)
        run["TTFT restore cold"] = ttft
        runs.append(run)
    order = [phase for _, _, phase in _PHASES] + ["other (manifest reads, tokenize, ...)", "TTFT restore cold"]
    return [(phase, statistics.median(r.get(phase, 0.0) for r in runs)) for phase in order if phase in runs[0]]


def op_profile(engine: Engine, n: int, top: int = 6) -> list[tuple[str, float]]:
    """Self CPU ms of the torch operators that take most of one cold restored TTFT (the graft of `profile`), and
    the rest, from torch's profiler."""
    put = engine.put(_text(n))
    assert isinstance(engine.store, LocalStore)
    for path in _graft_files(engine.store, put.id):
        _evict(path)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.generate(PROMPT, graft_id=put.id, params=ONE_TOKEN)
    ops = sorted(((e.key, e.self_cpu_time_total / 1000) for e in prof.key_averages()), key=lambda kv: -kv[1])
    return [*ops[:top], ("other operators", sum(ms for _, ms in ops[top:]))]


def compare_paths(engine: Engine, n: int, repeats: int) -> dict[str, float | int | bool]:
    """The block-by-block load and `store.get`, cold and warm, interleaved in one run (medians of `repeats`)."""
    put = engine.put(_text(n))
    assert isinstance(engine.store, LocalStore)
    store, paths = engine.store, _graft_files(engine.store, put.id)
    loaders: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
        "block_by_block": lambda: _block_by_block(store, store.manifest(put.id)),
        "store_get": lambda: store.get(put.id).tensors,
    }
    times: dict[str, list[float]] = {}
    digests: dict[str, set[str]] = {}
    for _ in range(repeats):
        for name, load in loaders.items():
            for state in ("cold", "warm"):
                if state == "cold":
                    for path in paths:
                        _evict(path)
                t0 = time.perf_counter()
                tensors = load()
                times.setdefault(f"{name}_{state}_s", []).append(time.perf_counter() - t0)
                hasher = hashlib.sha256()
                for key in sorted(tensors):
                    hasher.update(tensors[key].contiguous().view(-1).view(torch.uint8).numpy().data)
                digests.setdefault(name, set()).add(hasher.hexdigest())
                del tensors
        reads = _raw_read(paths), _raw_read_and_hash(paths)
        times.setdefault("raw_read_s", []).append(reads[0])
        times.setdefault("raw_read_sha256_s", []).append(reads[1])
    row: dict[str, float | int | bool] = {"tokens": n}
    row |= {name: statistics.median(values) for name, values in times.items()}
    row["same_bytes"] = len(digests["block_by_block"] | digests["store_get"]) == 1
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="512,1024,2048,4096,8192")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", action="store_true", help="break the cold restored TTFT into phases instead")
    parser.add_argument("--store", help="keep the grafts in this directory (a rerun reuses their blocks)")
    parser.add_argument(
        "--compare-paths", action="store_true", help="the block-by-block load vs store.get, side by side, instead"
    )
    parser.add_argument(
        "--attention",
        default=FAST_SDPA,
        help=f"attention implementations measured one after the other, comma-separated, of sdpa, {FAST_SDPA} "
        "(the same bytes: transformers' sdpa, and kvgraft's without its key/value copies); each row says which",
    )
    parser.add_argument(
        "--loads",
        default="store_get",
        help=f"load paths timed side by side, comma-separated, of {', '.join(LOAD_PATHS)} (the recompute is shared)",
    )
    args = parser.parse_args()
    loads = args.loads.split(",")
    if not set(loads) <= set(LOAD_PATHS):
        parser.error(f"--loads: one or more of {', '.join(LOAD_PATHS)}")
    sizes = [int(s) for s in args.sizes.split(",")]
    attentions = args.attention.split(",")
    if not set(attentions) <= {"sdpa", FAST_SDPA}:
        parser.error(f"--attention: one or more of sdpa, {FAST_SDPA}")
    model = llama_1b_like(args.layers)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgraft-bench-", dir=".") as tmp:
        root = Path(args.store) if args.store else Path(tmp)
        engine = Engine(model, build_byte_tokenizer(), "bench:llama-1b-like", args.chunk_size, LocalStore(root))
        model.set_attn_implementation(attentions[0])
        if args.compare_paths:
            print("| tokens | path | cold ms | warm ms | warm / raw read+SHA-256 | warm / raw read | same bytes |")
            print("|---:|---|---:|---:|---:|---:|:---:|")
            for n in [int(s) for s in args.sizes.split(",")]:
                r = compare_paths(engine, n, args.repeats)
                for name in ("block_by_block", "store_get"):
                    cold, warm = float(r[f"{name}_cold_s"]), float(r[f"{name}_warm_s"])
                    print(
                        f"| {n} | {name} | {cold * 1000:.0f} | {warm * 1000:.0f} | "
                        f"{warm / float(r['raw_read_sha256_s']):.2f} | {warm / float(r['raw_read_s']):.2f} | "
                        f"{'yes' if r['same_bytes'] else 'NO'} |"
                    )
            return
        if args.profile:
            for n in [int(s) for s in args.sizes.split(",")]:
                for name in loads:
                    with _load_path(name):
                        table = profile(engine, n, args.repeats)
                    total = dict(table)["TTFT restore cold"]
                    print(
                        f"\n{n}-token prefix, load {name}, cold, medians of {args.repeats}, "
                        f"{torch.get_num_threads()} torch threads"
                    )
                    print("| phase | ms | % of TTFT |\n|---|---:|---:|")
                    for phase, seconds in table:
                        print(f"| {phase} | {seconds * 1000:.1f} | {100 * seconds / total:.1f} |")
                    ops = op_profile(engine, n)
                    every = sum(ms for _, ms in ops)
                    print(f"\ntorch operators of one more cold restore ({attentions[0]}), self CPU time")
                    print("| operator | ms | % |\n|---|---:|---:|")
                    for op, ms in ops:
                        print(f"| {op} | {ms:.1f} | {100 * ms / every:.1f} |")
            return
        for n in sizes:
            for attention in attentions:
                model.set_attn_implementation(attention)  # the same bytes: the grafts stay valid under both
                rows.extend({"attention": attention} | row for row in measure(engine, n, args.repeats, loads))
            print(f"done {n} tokens", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"layers": args.layers, "threads": torch.get_num_threads(), "rows": rows}))
        return
    print(
        f"Llama-1B-like ({args.layers} layers, hidden 2048, 8 KV heads x 64), fp32, C={args.chunk_size}, "
        f"{torch.get_num_threads()} threads; medians of {args.repeats} (recompute: 1 run)"
    )
    print(
        "| prefix tokens | attention | load | graft MB | TTFT recompute | TTFT restore cold | TTFT restore warm | "
        "speed-up cold | load+verify GB/s | "
        "raw read+SHA-256 GB/s | raw read GB/s | load / read+sha | load / read | exact |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['attention']} | {r['load_path']} | {r['graft_bytes'] / 1e6:,.0f} | "
            f"{r['ttft_recompute_s']:.2f} s | "
            f"{r['ttft_restore_cold_s'] * 1000:.0f} ms | {r['ttft_restore_warm_s'] * 1000:.0f} ms | "
            f"{r['speedup_cold']:.0f}x | {r['load_verify_gb_s']:.2f} | {r['raw_read_sha256_gb_s']:.2f} | "
            f"{r['raw_read_gb_s']:.2f} | {r['load_over_raw']:.2f} | {r['load_over_read']:.2f} | "
            f"{'yes' if r['exact'] else 'NO'} |"
        )
    if len(attentions) > 1:
        same = all(len({r["logits_chain_sha256"] for r in rows if r["tokens"] == n}) == 1 for n in sizes)
        verdict = "yes" if same else "NO"
        print(f"\nfirst-token logits the same under {' and '.join(attentions)} at every size: {verdict}")


if __name__ == "__main__":
    main()
