"""Time to first token with a graft restored from disk vs the prefix recomputed, and graft load throughput vs a
raw read + SHA-256 of the same bytes, side by side in one run.

Usage: python benchmarks/restore_vs_recompute.py [--sizes 512,1024,2048,4096,8192] [--layers 16] [--json]

The model has Llama-3.2-1B layer shapes (fp32, byte vocabulary, random weights). For each prefix length n the
graft holds n tokens; the query adds 16 prompt tokens and asks for one new token. "Restored" time to first token
counts reading the graft from disk with every tensor hash checked, rebuilding the cache and computing the
prompt; "cold" first evicts the graft's files (its blocks) from the page cache (posix_fadvise DONTNEED), "warm"
does not.
"Recomputed" runs the whole n + 16 tokens fresh under the same chunk schedule. Both runs must produce the same
first-token logits (compared by SHA-256), so every speed-up below is for an exact result.
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
from pathlib import Path

import torch

from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.models.byte_tokenizer import build_byte_tokenizer
from kvgraft.store import LocalStore

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


def _graft_files(store: LocalStore, graft_id: str) -> list[Path]:
    """The graft's own tensors file and every block file it names."""
    manifest = store.manifest(graft_id)
    return [Path(store.tensors_path(graft_id))] + [store.block_path(ref.key) for ref in manifest.blocks]


def _text(n_tokens: int) -> str:
    generator = torch.Generator().manual_seed(n_tokens)
    letters = "abcdefghijklmnopqrstuvwxyz     ,.\n"
    picks = torch.randint(0, len(letters), (n_tokens - 1,), generator=generator).tolist()
    return "".join(letters[i] for i in picks)  # + BOS = n tokens


def measure(engine: Engine, n: int, repeats: int) -> dict[str, float | int | bool]:
    put = engine.put(_text(n))
    assert isinstance(engine.store, LocalStore)
    paths = _graft_files(engine.store, put.id)
    cold, warm, results = [], [], []
    for _ in range(repeats):
        for path in paths:
            _evict(path)
        result = engine.generate(PROMPT, graft_id=put.id, params=ONE_TOKEN)
        cold.append(result.timings["ttft_s"])
        results.append(result)
        warm.append(engine.generate(PROMPT, graft_id=put.id, params=ONE_TOKEN).timings["ttft_s"])
    input_ids = results[0].receipt.input_tokens
    fresh = engine.run_fresh(input_ids, ONE_TOKEN)
    recompute = fresh.ttft_s
    loads, raws = [], []
    for _ in range(repeats):  # warm page cache: this compares the CPU work of one pass against two
        t0 = time.perf_counter()
        engine.store.get(put.id)
        loads.append(time.perf_counter() - t0)
        raws.append(_raw_read_and_hash(paths))
    size = sum(path.stat().st_size for path in paths)
    return {
        "tokens": n,
        "graft_bytes": size,
        "ttft_recompute_s": recompute,
        "ttft_restore_cold_s": statistics.median(cold),
        "ttft_restore_warm_s": statistics.median(warm),
        "speedup_cold": recompute / statistics.median(cold),
        "speedup_warm": recompute / statistics.median(warm),
        "load_verify_gb_s": size / statistics.median(loads) / 1e9,
        "raw_read_sha256_gb_s": size / statistics.median(raws) / 1e9,
        "load_over_raw": statistics.median(loads) / statistics.median(raws),
        "exact": all(r.receipt.logits_chain_sha256 == fresh.logits_chain for r in results)
        and all(r.output_tokens == fresh.output_tokens for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="512,1024,2048,4096,8192")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = llama_1b_like(args.layers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvgraft-bench-", dir=".") as tmp:
        engine = Engine(model, build_byte_tokenizer(), "bench:llama-1b-like", args.chunk_size, LocalStore(Path(tmp)))
        for n in [int(s) for s in args.sizes.split(",")]:
            rows.append(measure(engine, n, args.repeats))
            print(f"done {n} tokens", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"layers": args.layers, "threads": torch.get_num_threads(), "rows": rows}))
        return
    print(
        f"Llama-1B-like ({args.layers} layers, hidden 2048, 8 KV heads x 64), fp32, C={args.chunk_size}, "
        f"{torch.get_num_threads()} threads; medians of {args.repeats} (recompute: 1 run)"
    )
    print(
        "| prefix tokens | graft MB | TTFT recompute | TTFT restore cold | TTFT restore warm | speed-up cold | "
        "load+verify GB/s | raw read+SHA-256 GB/s | load / raw | exact |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['graft_bytes'] / 1e6:,.0f} | {r['ttft_recompute_s']:.2f} s | "
            f"{r['ttft_restore_cold_s'] * 1000:.0f} ms | {r['ttft_restore_warm_s'] * 1000:.0f} ms | "
            f"{r['speedup_cold']:.0f}x | {r['load_verify_gb_s']:.2f} | {r['raw_read_sha256_gb_s']:.2f} | "
            f"{r['load_over_raw']:.2f} | {'yes' if r['exact'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
