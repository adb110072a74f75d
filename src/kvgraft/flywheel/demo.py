"""`kvgraft demo`: build a graft from a bundled text, restore it, generate, and prove the run exact."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvgraft.core.sampling import SamplingParams
from kvgraft.core.schedule import ChunkCallback
from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_graft, verify_receipt

DEMO_MODEL = "random:gemma4"
DEMO_PROMPT = "\n\nIn one sentence, the rule of thumb:"


def bundled_text() -> str:
    """Returns: the text the exactness demo builds its graft from (kvgraft/data/demo_text.txt)."""
    return resources.files("kvgraft").joinpath("data/demo_text.txt").read_text(encoding="utf-8")


@dataclass(frozen=True, kw_only=True)
class DemoReport:
    """What the exactness demo built, ran and verified."""

    model: str
    graft_id: str
    graft_tokens: int
    aligned_tokens: int
    graft_bytes: int
    prompt_tokens: int
    new_tokens: int
    build_s: float
    ttft_restored_s: float
    ttft_recomputed_s: float
    graft_verified: bool
    receipt_verified: bool
    store: str

    @property
    def exact(self) -> bool:
        """Whether both the graft and the grafted run were proven equal to a fresh recompute."""
        return self.graft_verified and self.receipt_verified

    def to_json(self) -> dict[str, Any]:
        """Returns: every field, plus `ttft_speedup` (recomputed over restored) and `exact`."""
        speedup = self.ttft_recomputed_s / self.ttft_restored_s if self.ttft_restored_s else None
        return asdict(self) | {"ttft_speedup": speedup, "exact": self.exact}


def run_demo(
    store: Path,
    model: str = DEMO_MODEL,
    max_new_tokens: int = 32,
    on_chunk: ChunkCallback | None = None,
    device: str = "cpu",
) -> DemoReport:
    """Build a graft of the bundled text, generate after it, and verify the graft and the run against fresh ones.

    Args:
        store: the store directory the graft goes to.
        model: the model spec.
        max_new_tokens: the most tokens to generate.
        on_chunk: progress callback for the build.
        device: where the model runs (cpu, cuda, cuda:N, mps).

    Returns:
        The report.
    """
    engine = Engine.load(model, store=str(store), device=device)
    t0 = time.perf_counter()
    put = engine.put(bundled_text(), metadata={"title": "demo text"}, on_chunk=on_chunk)
    build_s = time.perf_counter() - t0
    result = engine.generate(DEMO_PROMPT, graft_id=put.id, params=SamplingParams(max_new_tokens=max_new_tokens))
    graft_check = verify_graft(engine, put.id)
    receipt_check = verify_receipt(engine, result.receipt)
    return DemoReport(
        model=model,
        graft_id=put.id,
        graft_tokens=put.tokens,
        aligned_tokens=put.aligned_tokens,
        graft_bytes=put.bytes,
        prompt_tokens=result.prompt_tokens,
        new_tokens=len(result.output_tokens),
        build_s=build_s,
        ttft_restored_s=result.timings["ttft_s"],
        ttft_recomputed_s=receipt_check.rerun_ttft_s,
        graft_verified=graft_check.exact,
        receipt_verified=receipt_check.exact,
        store=str(store),
    )
