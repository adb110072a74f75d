"""What exactness costs, side by side in one run: build time with MKL's CNR mode (kvgraft's default) vs without
(`MKL_CBWR=""`), a `check` build (every new block computed twice) vs a plain one, and a store verification
per graft against the build of the same graft.

Usage: python benchmarks/exactness_cost.py [--tokens 1024] [--layers 4] [--repeats 5] [--json]

The model has Llama-3.2-1B layer shapes (fp32, byte vocabulary, random weights, `--layers` of them). Each mode
runs in its own process (MKL reads its CNR mode once, at start); times are medians over `--repeats` builds of
the same text into an empty store, after one warm-up build.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TEXT_SEED = "Exactness has a price; this measures it. "


def _worker(tokens: int, layers: int, repeats: int) -> dict[str, Any]:
    from kvgraft.core import reproducibility
    from kvgraft.engine.engine import Engine
    from kvgraft.engine.verify import verify_graft
    from kvgraft.models.byte_tokenizer import build_byte_tokenizer
    from kvgraft.store import LocalStore

    from _shapes import llama_1b_like

    text = (TEXT_SEED * (tokens // len(TEXT_SEED) + 1))[: tokens - 1]  # + BOS = `tokens`, a multiple of C
    model = llama_1b_like(layers=layers)

    def timed(check: bool) -> tuple[float, str]:
        with tempfile.TemporaryDirectory() as root:
            engine = Engine(model, build_byte_tokenizer(), "llama-1b-like", store=LocalStore(Path(root)))
            t0 = time.perf_counter()
            graft_id = engine.put(text, check=check).id
            return time.perf_counter() - t0, graft_id

    timed(False)  # warm-up
    plain = [timed(False) for _ in range(repeats)]
    checked = [timed(True) for _ in range(repeats)]
    with tempfile.TemporaryDirectory() as root:
        engine = Engine(model, build_byte_tokenizer(), "llama-1b-like", store=LocalStore(Path(root)))
        graft_id = engine.put(text).id
        verify_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            assert verify_graft(engine, graft_id).exact
            verify_s.append(time.perf_counter() - t0)
    ids = {graft for _, graft in plain + checked}
    return {
        "settings": reproducibility.settings(),
        "build_s": statistics.median(t for t, _ in plain),
        "check_build_s": statistics.median(t for t, _ in checked),
        "verify_s": statistics.median(verify_s),
        "distinct_ids": len(ids),
    }


def _run(mode_env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--worker", "--tokens", str(args.tokens), "--layers", str(args.layers)]
    argv += ["--repeats", str(args.repeats)]
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | mode_env | {"HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.tokens, args.layers, args.repeats)))
        return
    cnr = _run({}, args)
    off = _run({"MKL_CBWR": ""}, args)
    result = {
        "tokens": args.tokens,
        "layers": args.layers,
        "cnr": cnr,
        "no_cnr": off,
        "cnr_over_no_cnr": cnr["build_s"] / off["build_s"],
        "check_over_plain": cnr["check_build_s"] / cnr["build_s"],
        "verify_over_build": cnr["verify_s"] / cnr["build_s"],
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.tokens} tokens, Llama-1B-like shapes, {args.layers} layers, fp32; medians of {args.repeats}")
    print(f"build, CNR {cnr['settings']['mkl_cbwr']}: {cnr['build_s']:.3f} s")
    print(f"build, CNR {off['settings']['mkl_cbwr']}: {off['build_s']:.3f} s")
    print(f"  CNR / no CNR: {result['cnr_over_no_cnr']:.2f}x")
    print(f"build --check: {cnr['check_build_s']:.3f} s ({result['check_over_plain']:.2f}x a plain build)")
    print(f"verify one graft: {cnr['verify_s']:.3f} s ({result['verify_over_build']:.2f}x its build)")


if __name__ == "__main__":
    main()
