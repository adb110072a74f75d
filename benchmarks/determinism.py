"""Exactness under load: build and verify the same texts many times, in-process and in fresh processes, while
busy-loop processes (started here, stopped at the end) compete for the CPU; count distinct graft ids per text and
failed verifications per configuration.

Usage: python benchmarks/determinism.py [--models random:llama,random:gemma3,random:gemma4,demo]
           [--dtypes float32,bfloat16] [--threads 1,2] [--texts 2] [--builds 16] [--verifies 16] [--fresh 2]
           [--load N] [--jobs 1] [--json] [--out FILE]

For each configuration (model, dtype, threads) one worker process builds every text `--builds` times into an
empty store (so every block is computed, none reused), puts each text once into the configuration's store, then
verifies each stored graft `--verifies` times (KV recomputed and compared by SHA-256, next-token logits too).
Then `--fresh` more worker processes each build every text once and verify every stored graft once: each of
them is a new process, with its own addresses, thread pools and library initialisation.

A configuration is exact when every text has one graft id over all its builds and no verification failed. For a
build whose id is not the text's usual one, the first block and tensors that differ are reported.

`--load` busy loops (default: one per CPU) keep the machine loaded; `--jobs` workers run side by side.
Run it on the code before and after a change to measure the change: the worker uses whatever kvgraft imports.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from _load import BusyLoad


def _texts(count: int, chars: int) -> list[str]:
    demo = resources.files("kvgraft.data").joinpath("demo_text.txt").read_text()
    return [demo[i * chars : (i + 1) * chars] for i in range(count)]


# --- worker (runs in its own process) --------------------------------------------------------------------------


def _block_hashes(built: Any) -> list[dict[str, str]]:
    from kvgraft.core.hashing import sha256_tensor

    return [{name: sha256_tensor(t)[:16] for name, t in sorted(block.items())} for block in built.blocks.values()]


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvgraft.engine.engine import Engine
    from kvgraft.engine.verify import verify_graft
    from kvgraft.store import open_store

    texts = _texts(args.texts, args.chars)
    with tempfile.TemporaryDirectory() as scratch:
        builder = Engine.load(args.model, dtype=args.dtype, store=open_store(scratch))
        builds: list[dict[str, Any]] = []
        for _ in range(args.builds):
            for index, text in enumerate(texts):
                built = builder.build(text)
                builds.append({"text": index, "id": built.manifest.id, "blocks": _block_hashes(built)})
    engine = Engine.load(args.model, dtype=args.dtype, store=open_store(args.store))
    stored = []
    if args.put:
        for index, text in enumerate(texts):
            built = engine.build(text)  # the store is empty for this text: every block computed
            builds.append({"text": index, "id": built.manifest.id, "blocks": _block_hashes(built)})
            stored.append(engine.store.put(built.manifest, built.tensors, built.blocks)[0])
    else:
        stored = json.loads(Path(args.store, "determinism-ids.json").read_text())
    verifications: list[dict[str, Any]] = []
    for _ in range(args.verifies):
        for index, graft_id in enumerate(stored):
            result = verify_graft(engine, graft_id)
            verifications.append(
                {"text": index, "exact": result.exact, "mismatched": result.mismatched, "logits": result.logits_equal}
            )
    if args.put:
        Path(args.store, "determinism-ids.json").write_text(json.dumps(stored))
    return {"builds": builds, "verifications": verifications, "threads_seen": torch.get_num_threads()}


# --- campaign ----------------------------------------------------------------------------------------------------


@dataclass
class ConfigResult:
    model: str
    dtype: str
    threads: int
    builds: int = 0
    verifications: int = 0
    failed_verifications: int = 0
    ids_per_text: dict[int, collections.Counter[str]] = field(default_factory=dict)
    odd_builds: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def extra_ids(self) -> int:
        """Distinct ids beyond one per text."""
        return sum(len(ids) - 1 for ids in self.ids_per_text.values())

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "threads": self.threads,
            "builds": self.builds,
            "extra_ids": self.extra_ids,
            "odd_builds": len(self.odd_builds),
            "verifications": self.verifications,
            "failed_verifications": self.failed_verifications,
            "wall_s": round(self.wall_s, 1),
            "odd_details": self.odd_builds[:5],
            "failure_details": self.failures[:5],
        }


def _run_worker(config: tuple[str, str, int], store: Path, args: argparse.Namespace, **kw: Any) -> dict[str, Any]:
    model, dtype, threads = config
    argv = [sys.executable, __file__, "--worker", "--model", model, "--dtype", dtype, "--threads", str(threads)]
    argv += ["--store", str(store), "--texts", str(args.texts), "--chars", str(args.chars)]
    argv += ["--builds", str(kw["builds"]), "--verifies", str(kw["verifies"])] + (["--put"] if kw["put"] else [])
    # Threads are set the way a user sets them for the CLI or a server, by environment, not torch.set_num_threads
    # (which also switches MKL's dynamic threading off, and so would hide what a plain run does).
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker {model}/{dtype}/{threads} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _first_difference(odd: list[dict[str, str]], usual: list[dict[str, str]]) -> dict[str, Any]:
    for index, (a, b) in enumerate(zip(odd, usual, strict=True)):
        if a != b:
            return {"block": index, "tensors": sorted(name for name in a if a[name] != b.get(name))}
    return {"block": None, "tensors": []}


def _campaign(config: tuple[str, str, int], root: Path, args: argparse.Namespace) -> ConfigResult:
    model, dtype, threads = config
    result = ConfigResult(model, dtype, threads)
    store = root / f"{model.replace(':', '_')}-{dtype}-{threads}"
    store.mkdir(parents=True)
    t0 = time.perf_counter()
    runs = [_run_worker(config, store, args, builds=args.builds, verifies=args.verifies, put=True)]
    runs += [_run_worker(config, store, args, builds=1, verifies=1, put=False) for _ in range(args.fresh)]
    result.wall_s = time.perf_counter() - t0
    builds = [build for run in runs for build in run["builds"]]
    for build in builds:
        result.ids_per_text.setdefault(build["text"], collections.Counter())[build["id"]] += 1
    usual = {text: ids.most_common(1)[0][0] for text, ids in result.ids_per_text.items()}
    usual_blocks = {b["text"]: b["blocks"] for b in builds if b["id"] == usual[b["text"]]}
    for build in builds:
        if build["id"] != usual[build["text"]]:
            where = _first_difference(build["blocks"], usual_blocks[build["text"]])
            result.odd_builds.append({"text": build["text"], "id": build["id"][:12], **where})
    result.builds = len(builds)
    for run in runs:
        for check in run["verifications"]:
            result.verifications += 1
            if not check["exact"]:
                result.failed_verifications += 1
                result.failures.append(check)
    return result


def _reported(result: ConfigResult) -> ConfigResult:
    """Progress on stderr, one line a configuration (a full campaign takes a while)."""
    s = result.summary()
    print(
        f"{s['model']}/{s['dtype']}/{s['threads']}: {s['builds']} builds, {s['extra_ids']} extra ids, "
        f"{s['verifications']} verifications, {s['failed_verifications']} failed, {s['wall_s']} s",
        file=sys.stderr,
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="random:llama,random:gemma3,random:gemma4,demo")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--texts", type=int, default=2)
    # ~8 chunks of 64 byte-tokens: several blocks per graft, fast enough for thousands of builds
    parser.add_argument("--chars", type=int, default=500, help="characters (= byte tokens) of each text")
    parser.add_argument("--builds", type=int, default=16, help="in-process builds of each text per configuration")
    parser.add_argument("--verifies", type=int, default=16, help="in-process verifications of each text")
    parser.add_argument("--fresh", type=int, default=2, help="fresh processes per configuration (1 build + 1 verify)")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy-loop processes")
    parser.add_argument("--jobs", type=int, default=1, help="configurations run side by side")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--out", type=Path, help="also write the full results here")
    # worker-only
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--put", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        print(json.dumps(_worker(args)))
        return

    configs = [
        (model, dtype, int(threads))
        for model in args.models.split(",")
        for dtype in args.dtypes.split(",")
        for threads in args.threads.split(",")
    ]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the load
    load = BusyLoad(args.load)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as root, ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(lambda config: _reported(_campaign(config, Path(root), args)), configs))
    finally:
        load.stop()
    wall = time.perf_counter() - t0
    summaries = [r.summary() for r in results]
    totals = {
        "configurations": len(results),
        "builds": sum(r.builds for r in results),
        "extra_ids": sum(r.extra_ids for r in results),
        "odd_builds": sum(len(r.odd_builds) for r in results),
        "verifications": sum(r.verifications for r in results),
        "failed_verifications": sum(r.failed_verifications for r in results),
        "load_processes": args.load,
        "wall_s": round(wall, 1),
    }
    if args.out:
        args.out.write_text(json.dumps({"totals": totals, "configurations": summaries}, indent=1))
    if args.json:
        print(json.dumps({**totals, "configurations_detail": summaries}))
        return
    print(
        f"{'model':<14} {'dtype':<9} {'thr':>3} {'builds':>6} {'extra ids':>9} {'verifies':>8} {'failed':>6} {'s':>6}"
    )
    for s in summaries:
        print(
            f"{s['model']:<14} {s['dtype']:<9} {s['threads']:>3} {s['builds']:>6} {s['extra_ids']:>9} "
            f"{s['verifications']:>8} {s['failed_verifications']:>6} {s['wall_s']:>6}"
        )
        for odd in s["odd_details"]:
            where = f"first differs at block {odd['block']}: {odd['tensors']}"
            print(f"    odd build: text {odd['text']} id {odd['id']}, {where}")
        for failure in s["failure_details"]:
            where = f"{failure['mismatched'][:4]}, logits equal: {failure['logits']}"
            print(f"    failed verification: text {failure['text']}: {where}")
    print(
        f"total: {totals['builds']} builds, {totals['extra_ids']} extra ids, {totals['verifications']} verifications, "
        f"{totals['failed_verifications']} failed, {totals['wall_s']} s under {args.load} busy loops"
    )


if __name__ == "__main__":
    main()
