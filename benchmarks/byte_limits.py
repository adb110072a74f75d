"""The physical limits of a restore on this machine, and the two byte-level options of issue 14, side by side.

Usage: python benchmarks/byte_limits.py [--mb 256] [--tokens 512] [--layers 16] [--levels 1,3] [--json]

Limits (one buffer of --mb MB, medians of 5): memcpy, SHA-256 and BLAKE3 on one thread and on every core (4 MB
pieces on a pool; BLAKE3 also with its own threads), and a file read of the same size from the page cache (warm)
and after evicting it (cold).

Compression (lossless, measure then decide): the KV cache of real runs, each tensor split into byte planes
(shuffle: byte 0 of every element, then byte 1, ...) or bit planes and compressed with zstd or lz4 by blosc2 (SIMD
filters, threads) at each --levels, on one thread and on every core, and zstd without a filter for comparison.
Sources: the demo model (trained) over its demo text, random:llama in fp32 and bf16, and Llama-1B layer shapes
(random weights) in fp32 and bf16 over --tokens tokens. Every round trip is checked byte for byte.
For each codec it reports the ratio, compression MB/s and decompression GB/s (output bytes), and the disk read
speed below which it would make a cold restore faster: a restore reads B/ratio bytes and decompresses B, so it
pays only where disk GB/s < decompress GB/s x (1 - 1/ratio).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import blosc2
import numpy as np
import torch
from restore_vs_recompute import _evict
from transformers import DynamicCache, PreTrainedModel

from kvgraft.core.schedule import ChunkSchedule, forward_tokens
from kvgraft.models.loading import load_model

from _shapes import llama_1b_like

PIECE = 4 << 20
DEMO_TEXT = Path(__file__).resolve().parents[1] / "src" / "kvgraft" / "data" / "demo_text.txt"


def _gb_s(size: int, fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times) / 1e9


def limits(megabytes: int) -> dict[str, float]:
    """GB/s of memcpy, the two digests (1 thread, all cores) and a file read, warm and cold."""
    size = megabytes << 20
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    target = np.empty_like(data)
    view = memoryview(data.data)
    pieces = [view[i : i + PIECE] for i in range(0, size, PIECE)]
    cores = os.cpu_count() or 1

    def pooled(digest: Callable[[memoryview], object]) -> Callable[[], object]:
        return lambda: list(pool.map(digest, pieces))

    with ThreadPoolExecutor(cores) as pool, tempfile.TemporaryDirectory(prefix="kvgraft-limits-", dir=".") as tmp:
        path = Path(tmp) / "bytes"
        path.write_bytes(data.tobytes())
        os.sync()

        def cold_read() -> bytes:
            _evict(path)
            return path.read_bytes()

        figures = {
            "memcpy_gb_s": _gb_s(size, lambda: np.copyto(target, data)),
            "sha256_1_thread_gb_s": _gb_s(size, lambda: hashlib.sha256(view).digest()),
            "sha256_all_cores_gb_s": _gb_s(size, pooled(lambda piece: hashlib.sha256(piece).digest())),
            "blake3_1_thread_gb_s": _gb_s(size, lambda: blake3.blake3(view).digest()),
            "blake3_all_cores_gb_s": _gb_s(size, pooled(lambda piece: blake3.blake3(piece).digest())),
            "blake3_own_threads_gb_s": _gb_s(
                size, lambda: blake3.blake3(view, max_threads=blake3.blake3.AUTO).digest()
            ),
            "read_warm_gb_s": _gb_s(size, path.read_bytes),
            "read_cold_gb_s": _gb_s(size, cold_read, repeats=3),
        }
    return figures | {"cores": cores, "megabytes": megabytes}


def kv_tensors(model: PreTrainedModel, tokens: list[int]) -> list[torch.Tensor]:
    """Every cached key and value tensor after `tokens` under the chunk schedule (C=64), [batch, heads, seq, dim]."""
    cache = DynamicCache(config=model.config)
    forward_tokens(model, cache, tokens, 0, ChunkSchedule(64))
    out = []
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                out.append(tensor.contiguous())
    return out


CODECS: dict[str, tuple[blosc2.Codec, blosc2.Filter]] = {
    "zstd": (blosc2.Codec.ZSTD, blosc2.Filter.NOFILTER),
    "shuffle+zstd": (blosc2.Codec.ZSTD, blosc2.Filter.SHUFFLE),
    "bitshuffle+zstd": (blosc2.Codec.ZSTD, blosc2.Filter.BITSHUFFLE),
    "shuffle+lz4": (blosc2.Codec.LZ4, blosc2.Filter.SHUFFLE),
}
"""Codec name -> (blosc2 codec, filter). Blosc2 splits each tensor into byte planes (shuffle) or bit planes
(bitshuffle) with SIMD code, then compresses; "zstd" alone is the baseline without a filter."""


def codec_row(tensors: list[torch.Tensor], name: str, level: int, threads: int) -> dict[str, Any]:
    """Ratio, compression MB/s and decompression GB/s of one codec over the tensors, each a frame of its own."""
    codec, filter_ = CODECS[name]
    raws = [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    settings = [
        {"codec": codec, "clevel": level, "filters": [filter_], "typesize": t.element_size(), "nthreads": threads}
        for t in tensors
    ]
    t0 = time.perf_counter()
    frames = [blosc2.compress2(raw, **kw) for raw, kw in zip(raws, settings, strict=True)]
    compress_s = time.perf_counter() - t0

    def restore() -> list[bytes]:
        return [blosc2.decompress2(frame, nthreads=threads) for frame in frames]

    total = sum(len(raw) for raw in raws)
    decompress_gb_s = _gb_s(total, restore)
    ratio = total / sum(len(frame) for frame in frames)
    return {
        "codec": f"{name}-{level}",
        "threads": threads,
        "bytes": total,
        "ratio": ratio,
        "compress_mb_s": total / compress_s / 1e6,
        "decompress_gb_s": decompress_gb_s,
        "pays_below_disk_gb_s": decompress_gb_s * (1 - 1 / ratio),
        "lossless": [bytes(r) for r in restore()] == raws,
    }


def sources(tokens: int, layers: int) -> dict[str, list[torch.Tensor]]:
    """Name -> KV tensors of one run: the demo model, random:llama fp32/bf16, Llama-1B shapes fp32/bf16."""
    out: dict[str, list[torch.Tensor]] = {}
    demo, tokenizer = load_model("demo")
    ids = tokenizer(DEMO_TEXT.read_text())["input_ids"][:1024]
    out[f"demo model, fp32, {len(ids)} tokens"] = kv_tensors(demo, ids)
    text_ids = [(i * 7919) % 200 + 3 for i in range(tokens)]
    for dtype in ("float32", "bfloat16"):
        model, _ = load_model("random:llama", dtype=dtype)
        out[f"random:llama, {dtype}, {tokens} tokens"] = kv_tensors(model, text_ids)
    big = llama_1b_like(layers)
    for dtype in (torch.float32, torch.bfloat16):
        out[f"Llama-1B shapes ({layers} layers), {str(dtype)[6:]}, {tokens} tokens"] = kv_tensors(
            big.to(dtype), text_ids
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="buffer size for the limits")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--levels", default="1,3")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = limits(args.mb)
    rows = []
    for name, tensors in sources(args.tokens, args.layers).items():
        for codec in CODECS:
            for level in [int(x) for x in args.levels.split(",")]:
                for threads in sorted({1, os.cpu_count() or 1}):
                    rows.append({"source": name} | codec_row(tensors, codec, level, threads))
    if args.json:
        print(json.dumps({"limits": figures, "compression": rows}))
        return
    print(f"Limits ({figures['cores']} cores, {args.mb} MB, medians of 5; cold read: 3)")
    print("| figure | GB/s |\n|---|---:|")
    for key, value in figures.items():
        if key.endswith("_gb_s"):
            print(f"| {key.removesuffix('_gb_s').replace('_', ' ')} | {value:.2f} |")
    print(
        "\n| KV source | codec | threads | MB | ratio | compress MB/s | decompress GB/s | pays below disk GB/s "
        "| lossless |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(
            f"| {r['source']} | {r['codec']} | {r['threads']} | {r['bytes'] / 1e6:.1f} | {r['ratio']:.3f} | "
            f"{r['compress_mb_s']:.0f} | "
            f"{r['decompress_gb_s']:.2f} | {r['pays_below_disk_gb_s']:.2f} | {'yes' if r['lossless'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
