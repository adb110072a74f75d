"""Load test of `kvgraft serve` on loopback: requests/s and latency with and without grafting.

Usage: python benchmarks/serve_load.py [--model demo] [--requests 200] [--concurrency 8] [--max-tokens 8]
       [--url http://127.0.0.1:8000 --api-key KEY] [--max-seconds 300] [--json]

Starts the server in this process on 127.0.0.1 (or uses --url, which must be a loopback address, with a key that
may write the library), stores one context block (worked problems filling most of the demo model's window), then
for each mode sends a fixed number of requests with a fixed concurrency through httpx's asyncio client, each mode
bounded by --max-seconds:

- bare: the block's text and the question as one prompt, grafting off (the model reads the block every time);
- grafted: the question only, the block named in `kvgraft.grafts` (restored instead of read);
- retrieved: the question only, grafting by default retrieval (the server finds the block itself).

Questions are the block's own problems, cycled. It reports requests/s, p50/p99 latency, errors, how many replies
used a graft, and whether every grafted reply equals the bare reply to the same question.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

MODES = ("bare", "grafted", "retrieved")


@dataclass
class ModeResult:
    mode: str
    sent: int = 0
    errors: int = 0
    grafted: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)
    """question -> reply text (the first reply to each question)"""
    error_samples: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = len(self.latencies_s)
        return {
            "mode": self.mode,
            "requests": self.sent,
            "ok": ok,
            "errors": self.errors,
            "grafted": self.grafted,
            "requests_per_s": ok / self.wall_s if self.wall_s else 0.0,
            "p50_ms": 1000 * _pct(self.latencies_s, 0.50),
            "p99_ms": 1000 * _pct(self.latencies_s, 0.99),
            "mean_ms": 1000 * statistics.fmean(self.latencies_s) if self.latencies_s else 0.0,
            "error_samples": self.error_samples[:3],
        }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_block(window: int, reserve: int) -> tuple[str, list[dict[str, str]], list[str]]:
    """Worked problems packed into one block of at most (window - reserve) tokens (byte tokenizer: a token per
    byte, plus BOS); returns the text, its block metadata entries and the questions (their prompts)."""
    from kvgraft.flywheel.problems import prompt_of, training_problems

    entries, problems, questions, size = [], [], [], 1
    for problem in training_problems(7_000_001, 60):
        entry = prompt_of(problem.text) + problem.solution + "\n"
        if size + len(entry.encode()) > window - reserve:
            break
        entries.append(entry)
        problems.append({"id": f"load-{len(problems)}", "problem_sha256": problem.text_sha256, "text": problem.text})
        questions.append(prompt_of(problem.text))
        size += len(entry.encode())
    return "".join(entries), problems, questions


@contextlib.contextmanager
def local_server(model: str, api_key: str, max_queue: int) -> Iterator[str]:
    from kvgraft.engine.engine import Engine
    from kvgraft.server import ServerConfig, create_app
    from kvgraft.server.background import serve_in_thread

    with tempfile.TemporaryDirectory(prefix="kvgraft-serve-load-") as tmp:
        engine = Engine.load(model, store=tmp, cache_bytes=256 << 20)
        config = ServerConfig(api_key=api_key, max_queue=max_queue, max_tokens_limit=256)
        with serve_in_thread(create_app(engine, config), host="127.0.0.1", port=0) as server:
            yield server.url


async def run_mode(
    client: httpx.AsyncClient,
    mode: str,
    model: str,
    block: str,
    graft_id: str,
    questions: list[str],
    requests: int,
    concurrency: int,
    max_tokens: int,
    max_seconds: float,
) -> ModeResult:
    result = ModeResult(mode)
    counter = iter(range(requests))
    deadline = time.monotonic() + max_seconds

    def body(question: str) -> dict[str, Any]:
        common = {"model": model, "max_tokens": max_tokens, "stop": ["\n"]}
        if mode == "bare":
            return common | {"prompt": block + question, "kvgraft": {"retrieve": False}}
        if mode == "grafted":
            return common | {"prompt": question, "kvgraft": {"grafts": [graft_id]}}
        return common | {"prompt": question}

    async def user() -> None:
        for i in counter:
            if time.monotonic() > deadline:
                return
            question = questions[i % len(questions)]
            result.sent += 1
            started = time.perf_counter()
            try:
                reply = await client.post("/v1/completions", json=body(question))
                elapsed = time.perf_counter() - started
                if reply.status_code != 200:
                    result.errors += 1
                    result.error_samples.append(f"{reply.status_code} {reply.text[:200]}")
                    continue
                data = reply.json()
            except (httpx.HTTPError, ValueError) as exc:
                result.errors += 1
                result.error_samples.append(f"{type(exc).__name__}: {exc}")
                continue
            result.latencies_s.append(elapsed)
            result.grafted += bool(data["kvgraft"]["grafts"])
            result.texts.setdefault(question, data["choices"][0]["text"])

    started = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - started
    return result


async def load_test(url: str, api_key: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        block, problems, questions = make_block(window=1024, reserve=args.max_tokens + 96)
        made = await client.post(
            "/v1/grafts", json={"text": block, "metadata": {"kind": "block", "problems": problems}}
        )
        if made.status_code not in (200, 201):
            raise SystemExit(f"cannot store the block: {made.status_code} {made.text}")
        graft = made.json()
        # Warm-up, not measured: first calls pay for lazy initialisation (the retrieval index, allocator pools).
        for mode in MODES:
            await run_mode(client, mode, model, block, graft["id"], questions, 2, 1, args.max_tokens, 60)
        results = {}
        for mode in MODES:
            results[mode] = await run_mode(
                client,
                mode,
                model,
                block,
                graft["id"],
                questions,
                args.requests,
                args.concurrency,
                args.max_tokens,
                args.max_seconds,
            )
    bare = results["bare"].texts
    compared = [q for q in results["grafted"].texts if q in bare]
    same = sum(results["grafted"].texts[q] == bare[q] for q in compared)
    return {
        "model": model,
        "url": url,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "block_tokens": graft["tokens"],
        "block_restored_tokens": graft["aligned_tokens"],
        "questions": len(questions),
        "grafted_equal_bare": {"equal": same, "compared": len(compared)},
        "modes": {mode: r.summary() for mode, r in results.items()},
        "errors": sum(r.errors for r in results.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="demo", help="Model of the in-process server (demo: 1,024 positions).")
    parser.add_argument("--url", default=None, help="Use this running server instead (loopback only).")
    parser.add_argument("--api-key", default=None, help="Its API key (library writes); in-process: generated.")
    parser.add_argument("--requests", type=int, default=200, help="Requests per mode.")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=300.0, help="Stop sending in a mode after this.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.url is not None:
        host = urlparse(args.url).hostname or ""
        if not (host == "localhost" or host.startswith("127.") or host == "::1"):
            raise SystemExit("--url must be a loopback address (127.0.0.0/8, localhost or ::1)")
        if not args.api_key:
            raise SystemExit("--url needs --api-key (the block is stored through POST /v1/grafts)")
        data = asyncio.run(load_test(args.url, args.api_key, args))
    else:
        key = secrets.token_hex(16)
        with local_server(args.model, key, max_queue=max(16, args.concurrency)) as url:
            data = asyncio.run(load_test(url, key, args))
    if args.json:
        print(json.dumps(data))
        return
    print(
        f"{data['model']}: {data['requests']} requests per mode, concurrency {data['concurrency']}, "
        f"max_tokens {data['max_tokens']}, block {data['block_tokens']} tokens "
        f"({data['block_restored_tokens']} restored when grafted)"
    )
    print("| mode | ok | errors | grafted | requests/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m in data["modes"].values():
        print(
            f"| {m['mode']} | {m['ok']} | {m['errors']} | {m['grafted']} | {m['requests_per_s']:.1f} "
            f"| {m['p50_ms']:.0f} | {m['p99_ms']:.0f} |"
        )
    eq = data["grafted_equal_bare"]
    print(f"grafted replies equal to bare replies of the same question: {eq['equal']}/{eq['compared']}")
    if data["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
