"""Effective context: a library of grafts far larger than the model's window, served under a fixed memory budget.

Usage: python benchmarks/effective_context.py [--scale 1.0 | --tokens N] [--workers 1] [--store DIR] [--queries 200]
       [--json]

Builds (or reuses, in --store) a library of context blocks for the demo model (window 1,024 tokens): worked
problems packed into blocks of about 1,000 tokens, 2,854,766 library tokens at --scale 1 (the published figure),
built by --workers processes. Then, for the library at 1%, 10% and 100% of its grafts (the smaller ones as stores of
their own, hard links into the big one), a fresh process serves a stream of queries (problems held in the library):
BM25 retrieval of the best block, restore with an LRU RAM tier bounded at --cache-mb, and time to first token. It
reports library tokens vs the window, bytes on disk, peak resident memory per library size, retrieval and restore
latency p50/p99, and time to first token with the block restored vs recomputed.

Then the dedup check: --dedup-grafts grafts that share a 1,024-token preamble (random:gemma3, which has sliding
and full layers and 4,096 positions; C=64), built into a store of their own. It reports block files and bytes on
disk against what the grafts would take each on its own, the build time of the first graft (which computes the
preamble) against the median of the others (which read it back), and verifies one graft bitwise against a fresh
recompute.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PUBLISHED_TOKENS = 2_854_766
PREAMBLE_TOKENS = 1024


def dedup(store_dir: Path, grafts: int) -> dict[str, Any]:
    """Grafts sharing a 1,024-token preamble: is the preamble stored once, and is a graft still exact?"""
    from kvgraft.engine.engine import Engine
    from kvgraft.engine.verify import verify_graft
    from kvgraft.library.index import store_stats
    from kvgraft.store import LocalStore

    engine = Engine.load("random:gemma3", store=str(store_dir))
    # The byte tokenizer gives one token per byte after BOS: 1,023 bytes make a 1,024-token preamble.
    sentence = "All answers below follow the same house rules for units, rounding and layout. "
    preamble = (sentence * 20)[: PREAMBLE_TOKENS - 1]
    build_s, puts = [], []
    for index in range(grafts):
        body = f" Document {index}: " + f"item {index} has weight {3 * index + 1} and cost {7 * index + 2}. " * 6
        t0 = time.perf_counter()
        puts.append(engine.put(preamble + body))
        build_s.append(time.perf_counter() - t0)
    local = LocalStore(store_dir)
    stats = store_stats(local)
    check = verify_graft(engine, puts[-1].id)
    preamble_blocks = PREAMBLE_TOKENS // engine.schedule.chunk_size
    return {
        "grafts": grafts,
        "preamble_tokens": PREAMBLE_TOKENS,
        "blocks_named": sum(p.blocks for p in puts),
        "block_files": len(local.block_files()),
        "preamble_blocks": preamble_blocks,
        "reused_blocks": [p.reused_blocks for p in puts],
        "disk_bytes": stats.disk_bytes,
        "logical_bytes": stats.logical_bytes,
        "dedup_ratio": stats.dedup_ratio,
        "build_first_s": build_s[0],
        "build_rest_median_s": statistics.median(build_s[1:]) if grafts > 1 else None,
        "verified_exact": check.exact,
    }


def build(store_dir: Path, target_tokens: int, workers: int) -> None:
    """Fill the store to `target_tokens` library tokens with `workers` processes (one torch thread each by default,
    so one per core), each building its own share from its own seeds; the store's lock keeps their puts apart."""
    if workers == 1:
        build_part(store_dir, target_tokens, 0, 1)
        return
    share = -(-target_tokens // workers)
    command = [sys.executable, __file__, "--tokens", str(share), "--store", str(store_dir), "--build-part"]
    children = [subprocess.Popen([*command, f"{k}/{workers}"]) for k in range(workers)]
    failed = [child.args for child in children if child.wait() != 0]
    if failed:
        raise SystemExit(f"{len(failed)} build worker(s) failed")


def build_part(store_dir: Path, target_tokens: int, part: int, parts: int) -> None:
    """Worker `part` of `parts`: blocks from seeds 500,001 + part, + parts, ... until they hold `target_tokens`
    tokens. Blocks this worker stored before (a resumed build) are counted, not built again."""
    from kvgraft.engine.engine import Engine
    from kvgraft.flywheel.problems import prompt_of, training_problems
    from kvgraft.library.index import load_index

    engine = Engine.load("demo", store=str(store_dir))
    done: dict[int, int] = {}
    for entry in load_index(engine.store).values():  # the parent brought the index up to date
        first = entry.problems[0]["id"] if entry.problems else "lib-0-0"
        done[int(first.split("-")[1])] = entry.tokens
    seeds = itertools.count(500_001 + part, parts)
    have, built, started = 0, 0, time.perf_counter()
    while have < target_tokens:
        seed = next(seeds)
        if seed in done:
            have += done[seed]
            continue
        entries, problems, size = [], [], 1
        for problem in training_problems(seed, 40):
            entry = prompt_of(problem.text) + problem.solution + "\n"
            cost = len(entry.encode())
            if size + cost > 1024 - 160:  # room for the query and its answer
                break
            entries.append(entry)
            problems.append(
                {"id": f"lib-{seed}-{len(problems)}", "problem_sha256": problem.text_sha256, "text": problem.text}
            )
            size += cost
        put = engine.put("".join(entries), metadata={"kind": "block", "problems": problems})
        have += put.tokens
        built += put.tokens
        if (seed // parts) % 200 == 0:
            rate = built / (time.perf_counter() - started)
            line = f"worker {part}: {have:,} / {target_tokens:,} tokens ({rate:,.0f} tokens/s)"
            print(line, file=sys.stderr, flush=True)


def library_view(source: Path, fraction: float, into: Path) -> Path:
    """The library at `fraction` of its grafts (the first by id) as a store of its own, made of hard links to the
    source's graft directories and the blocks they name: no bytes copied, and the process serving it reads only its
    own part's manifests and index, as a library of that size would."""
    from kvgraft.store import LocalStore

    if fraction >= 1.0:
        return source
    store = LocalStore(source)
    root = source.resolve()
    ids = store.ids()
    for graft_id in ids[: max(1, round(len(ids) * fraction))]:
        graft_dir = Path(store.tensors_path(graft_id)).parent
        blocks = [store.block_path(ref.key).resolve() for ref in store.manifest(graft_id).blocks]
        for path in [*graft_dir.iterdir(), *blocks]:
            target = into / path.relative_to(root)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(path, target)
    return into


def serve(store_dir: Path, queries: int, cache_mb: int) -> dict[str, Any]:
    """Runs in its own process, so that its peak resident memory is its own."""
    from kvgraft.core.sampling import SamplingParams
    from kvgraft.engine.engine import Engine
    from kvgraft.flywheel.problems import prompt_of
    from kvgraft.library.library import Library
    from kvgraft.store import LocalStore
    from kvgraft.store.cache import CachedStore

    local = LocalStore(store_dir)
    engine = Engine.load("demo", store=CachedStore(local, cache_mb << 20))
    rss_before = _rss_now()
    t0 = time.perf_counter()
    library = Library.from_store(local)
    rng = random.Random(0)
    picks = [rng.choice(library.block_entries) for _ in range(queries)]
    library.search_blocks(picks[0][2], k=1)  # BM25 indexes at the first search: here, outside the timed queries
    open_s = time.perf_counter() - t0
    rss_library = _rss_now() - rss_before
    retrieval, restore, ttft_restore, ttft_recompute, hits = [], [], [], [], 0
    params = SamplingParams(max_new_tokens=1)
    for index, (graft_id, _, text) in enumerate(picks):
        t0 = time.perf_counter()
        best = library.search_blocks(text, k=1)[0]
        retrieval.append(time.perf_counter() - t0)
        hits += best.graft_id == graft_id
        t0 = time.perf_counter()
        engine.restore(best.graft_id)
        restore.append(time.perf_counter() - t0)
        result = engine.generate(prompt_of(text), graft_id=best.graft_id, params=params)
        ttft_restore.append(result.timings["ttft_s"])
        if index < 20:  # recomputing the whole block each time is the slow path: a sample suffices
            fresh = engine.run_fresh(result.receipt.input_tokens, params)
            ttft_recompute.append(fresh.ttft_s)
    return {
        "grafts": len(local.ids()),
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_end_bytes": _rss_now(),
        "library_rss_bytes": rss_library,
        "library_open_s": open_s,
        "retrieval_s": retrieval,
        "restore_s": restore,
        "ttft_restore_s": ttft_restore,
        "ttft_recompute_s": ttft_recompute,
        "retrieval_hit_rate": hits / len(picks),
    }


def _rss_now() -> int:
    """Resident bytes now (Linux's /proc; these benchmarks run on Linux), beside the peak, which a moment's
    allocation can set."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="Library tokens as a multiple of the published 2.85M.")
    parser.add_argument("--tokens", type=int, default=None, help="Library tokens (instead of --scale).")
    parser.add_argument("--workers", type=int, default=1, help="Build processes (one per core pays: 1 thread each).")
    parser.add_argument("--store", type=Path, default=None, help="Build into / reuse this store.")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--cache-mb", type=int, default=16)
    parser.add_argument("--dedup-grafts", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--build-part", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        print(json.dumps(serve(args.store, args.queries, args.cache_mb)))
        return
    if args.build_part is not None:
        part, parts = (int(x) for x in args.build_part.split("/"))
        build_part(args.store, args.tokens, part, parts)
        return
    from kvgraft.library.index import load_index, store_stats
    from kvgraft.store import LocalStore

    with tempfile.TemporaryDirectory(prefix="kvgraft-library-", dir=".") as tmp:
        store_dir = args.store or Path(tmp)
        target = args.tokens or round(PUBLISHED_TOKENS * args.scale)
        # Brings the index up to date (read by every library that opens the store) before the build's clock starts.
        before = store_stats(LocalStore(store_dir)).tokens
        started = time.perf_counter()
        build(store_dir, target, args.workers)
        build_s = time.perf_counter() - started
        stats = store_stats(LocalStore(store_dir))  # and again, so that serving starts from a saved index
        runs = {}
        with tempfile.TemporaryDirectory(prefix="kvgraft-views-", dir=store_dir.resolve().parent) as views:
            for label, fraction in (("1%", 0.01), ("10%", 0.10), ("100%", 1.0)):
                view = library_view(store_dir, fraction, Path(views) / label.rstrip("%"))
                load_index(LocalStore(view))
                command = [sys.executable, __file__, "--serve", "--store", str(view), "--queries", str(args.queries)]
                command += ["--cache-mb", str(args.cache_mb)]
                child = subprocess.run(command, capture_output=True, text=True, check=True)
                runs[label] = json.loads(child.stdout.strip().splitlines()[-1])
        full = runs["100%"]
        with tempfile.TemporaryDirectory(prefix="kvgraft-dedup-", dir=".") as dedup_tmp:
            shared = dedup(Path(dedup_tmp), args.dedup_grafts)
        result = {
            "library_tokens": stats.tokens,
            "grafts": stats.grafts,
            "window": 1024,
            "effective_ratio": stats.tokens / 1024,
            "disk_bytes": stats.disk_bytes,
            "logical_bytes": stats.logical_bytes,
            "dedup_ratio": stats.dedup_ratio,
            "build_s": build_s,
            "built_tokens": stats.tokens - before,
            "build_tokens_per_s": (stats.tokens - before) / build_s,
            "build_workers": args.workers,
            "cache_budget_bytes": args.cache_mb << 20,
            "grafts_served": {label: run["grafts"] for label, run in runs.items()},
            "rss_peak_bytes": {label: run["rss_peak_bytes"] for label, run in runs.items()},
            "rss_100_over_1": runs["100%"]["rss_peak_bytes"] / runs["1%"]["rss_peak_bytes"],
            "rss_end_bytes": {label: run["rss_end_bytes"] for label, run in runs.items()},
            "library_rss_bytes": {label: run["library_rss_bytes"] for label, run in runs.items()},
            "library_open_s": {label: run["library_open_s"] for label, run in runs.items()},
            "retrieval_ms": {
                "p50": 1000 * _pct(full["retrieval_s"], 0.5),
                "p99": 1000 * _pct(full["retrieval_s"], 0.99),
            },
            "retrieval_hit_rate": full["retrieval_hit_rate"],
            "restore_ms": {"p50": 1000 * _pct(full["restore_s"], 0.5), "p99": 1000 * _pct(full["restore_s"], 0.99)},
            "ttft_restore_ms_p50": 1000 * statistics.median(full["ttft_restore_s"]),
            "ttft_restore_ms_p99": 1000 * _pct(full["ttft_restore_s"], 0.99),
            "ttft_recompute_ms_p50": 1000 * statistics.median(full["ttft_recompute_s"]),
            "ttft_restore_over_recompute": statistics.median(full["ttft_restore_s"])
            / statistics.median(full["ttft_recompute_s"]),
            "dedup": shared,
        }
    if args.json:
        print(json.dumps(result))
        return
    rss = result["rss_peak_bytes"]
    print(
        f"library {result['library_tokens']:,} tokens in {result['grafts']:,} grafts = "
        f"{result['effective_ratio']:,.0f}x the 1,024-token window; {result['disk_bytes'] / 1e9:.2f} GB on disk "
        f"({result['disk_bytes'] / result['library_tokens']:,.0f} bytes/token); {result['built_tokens']:,} tokens "
        f"built in {build_s:.0f} s by {args.workers} worker(s) ({result['build_tokens_per_s']:,.0f} tokens/s)"
    )
    print(
        f"peak RSS (LRU budget {args.cache_mb} MB): 1% {rss['1%'] / 2**20:.0f} MB, 10% {rss['10%'] / 2**20:.0f} MB, "
        f"100% {rss['100%'] / 2**20:.0f} MB (100%/1% = {result['rss_100_over_1']:.3f})"
    )
    end, held = result["rss_end_bytes"], result["library_rss_bytes"]
    print(
        "RSS at the end, 1% / 10% / 100%: "
        + " / ".join(f"{end[label] / 2**20:.0f}" for label in rss)
        + " MB, of which the library (index, texts, BM25): "
        + " / ".join(f"{held[label] / 2**20:.1f}" for label in rss)
        + " MB"
    )
    print(
        f"retrieval p50 {result['retrieval_ms']['p50']:.2f} ms, p99 {result['retrieval_ms']['p99']:.2f} ms "
        f"(own block first for {100 * result['retrieval_hit_rate']:.0f}% of queries); restore p50 "
        f"{result['restore_ms']['p50']:.2f} ms, p99 {result['restore_ms']['p99']:.2f} ms"
    )
    print(
        f"time to first token: restored {result['ttft_restore_ms_p50']:.1f} ms vs recomputed "
        f"{result['ttft_recompute_ms_p50']:.1f} ms (ratio {result['ttft_restore_over_recompute']:.2f}); restored p99 "
        f"{result['ttft_restore_ms_p99']:.1f} ms"
    )
    d = result["dedup"]
    print(
        f"dedup: {d['grafts']} grafts sharing a {d['preamble_tokens']:,}-token preamble "
        f"name {d['blocks_named']} blocks, "
        f"{d['block_files']} block files on disk (the preamble's {d['preamble_blocks']} once); "
        f"{d['disk_bytes'] / 2**20:.1f} MB on disk vs {d['logical_bytes'] / 2**20:.1f} MB logical "
        f"(dedup ratio {d['dedup_ratio']:.2f}); build {d['build_first_s']:.2f} s first vs "
        f"{d['build_rest_median_s']:.2f} s median after; last graft verified exact: {d['verified_exact']}"
    )


if __name__ == "__main__":
    main()
