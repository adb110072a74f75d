"""Decode speed by thread count, on an idle machine and under CPU load: torch's default threads against kvgraft's.

Usage: python benchmarks/threads.py [--models random:llama,demo] [--threads torch,kvgraft] [--load 0,2]
           [--tokens 32] [--repeats 3] [--json]

For each load level, `N` busy-loop processes (started here, stopped at the end) spin on the CPUs; for each model
and thread count a fresh worker process loads the model with `KVGRAFT_THREADS` set, warms up, then decodes
`--tokens` greedy tokens `--repeats` times and reports the median decode tok/s. `torch` stands for the count
torch picks by itself in a fresh process (what kvgraft used before it owned its thread count), `kvgraft` for
kvgraft's default (`kvgraft.core.reproducibility.default_threads()`); plain numbers are taken as they are.

Oversubscription is the point: torch's OpenMP threads spin at every barrier, so when busy processes take the
cores each parallel region waits for a descheduled thread. The table gives every thread count side by side
with its ratio to the first one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from _load import BusyLoad

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


# --- worker (runs in its own process) --------------------------------------------------------------------------


def _worker(model: str, tokens: int, repeats: int) -> dict[str, Any]:
    import tempfile

    import torch

    from kvgraft.core.sampling import SamplingParams
    from kvgraft.engine.engine import Engine
    from kvgraft.store import open_store

    with tempfile.TemporaryDirectory() as scratch:
        engine = Engine.load(model, store=open_store(scratch))
        params = SamplingParams(max_new_tokens=tokens)
        engine.generate(PROMPT, params=SamplingParams(max_new_tokens=4))  # warm-up: allocations, thread pool
        rates = [engine.generate(PROMPT, params=params).timings["decode_tokens_per_s"] for _ in range(repeats)]
    return {"tok_s": statistics.median(rates), "threads_seen": torch.get_num_threads()}


# --- driver ----------------------------------------------------------------------------------------------------


def _probe(code: str) -> int:
    """An integer a fresh Python prints (without the thread settings of this process's environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "KVGRAFT_THREADS")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def torch_default_threads() -> int:
    """What torch uses by itself in a fresh process (kvgraft not imported)."""
    return _probe("import torch; print(torch.get_num_threads())")


def kvgraft_default_threads() -> int:
    """kvgraft's default thread count in a fresh process (no KVGRAFT_THREADS)."""
    return _probe("from kvgraft.core.reproducibility import default_threads; print(default_threads())")


def run_worker(model: str, threads: int, tokens: int, repeats: int) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--worker", "--models", model, "--tokens", str(tokens)]
    argv += ["--repeats", str(repeats)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env |= {"HF_HUB_OFFLINE": "1", "KVGRAFT_THREADS": str(threads)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"worker {model}/{threads} threads failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def resolve(names: str) -> list[tuple[str, int]]:
    """(label, thread count) for each of `--threads`."""
    counts: list[tuple[str, int]] = []
    for name in names.split(","):
        if name == "torch":
            n = torch_default_threads()
            counts.append((f"torch default ({n})", n))
        elif name == "kvgraft":
            n = kvgraft_default_threads()
            counts.append((f"kvgraft default ({n})", n))
        else:
            counts.append((f"{int(name)} threads", int(name)))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="random:llama,demo")
    parser.add_argument("--threads", default="torch,kvgraft", help="torch, kvgraft or numbers, comma-separated")
    parser.add_argument("--load", default=f"0,{os.cpu_count() or 1}", help="busy-loop processes, comma-separated")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.models, args.tokens, args.repeats)))
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the load
    counts = resolve(args.threads)
    rows: list[dict[str, Any]] = []
    for load_count in (int(x) for x in args.load.split(",")):
        load = BusyLoad(load_count)
        try:
            time.sleep(0.5)  # let the loops get going
            for model in args.models.split(","):
                row: dict[str, Any] = {"model": model, "load": load_count, "runs": []}
                for label, threads in counts:
                    result = run_worker(model, threads, args.tokens, args.repeats)
                    row["runs"].append({"label": label, "threads": threads, **result})
                rows.append(row)
        finally:
            load.stop()
    summary = {"cpus": len(os.sched_getaffinity(0)), "tokens": args.tokens, "repeats": args.repeats, "rows": rows}
    if args.json:
        print(json.dumps(summary))
        return
    print(
        f"decode tok/s, median of {args.repeats} x {args.tokens} tokens; {summary['cpus']} CPUs; "
        f"ratio = this count / the first ({counts[0][0]})"
    )
    header = f"{'model':<14} {'busy':>4}" + "".join(f" {label:>22} {'ratio':>6}" for label, _ in counts)
    print(header)
    for row in rows:
        first = row["runs"][0]["tok_s"]
        cells = "".join(f" {run['tok_s']:>22.1f} {run['tok_s'] / first:>6.2f}" for run in row["runs"])
        print(f"{row['model']:<14} {row['load']:>4}{cells}")


if __name__ == "__main__":
    main()
