"""Prefill throughput of the fixed chunk schedule for several chunk sizes, side by side in one run.

Usage: python benchmarks/chunk_size.py [--tokens 1024] [--layers 16] [--sizes 16,32,64,128,256]
Prints tokens/s per chunk size (median of --repeats runs) and the ratio to the largest size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from kvgraft.core.schedule import ChunkSchedule, forward_tokens

from _shapes import llama_1b_like


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--sizes", default="16,32,64,128,256")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = llama_1b_like(args.layers)
    ids = torch.randint(3, 259, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    rates: dict[int, float] = {}
    for size in [int(s) for s in args.sizes.split(",")]:
        times = []
        for _ in range(args.repeats):
            cache = DynamicCache(config=model.config)
            t0 = time.perf_counter()
            forward_tokens(model, cache, ids, 0, ChunkSchedule(size))
            times.append(time.perf_counter() - t0)
        rates[size] = args.tokens / statistics.median(times)
    best = max(rates.values())
    print(
        f"prefill of {args.tokens} tokens, Llama-1B-like x{args.layers} layers, fp32, {torch.get_num_threads()} threads"
    )
    print("| C | tokens/s (median) | vs best |")
    print("|---|---|---|")
    for size, rate in rates.items():
        print(f"| {size} | {rate:,.0f} | {rate / best:.2f} |")


if __name__ == "__main__":
    main()
