"""Composition of grafts built separately: the error of the approximate (re-positioned) mode, measured.

Usage: python benchmarks/composition.py [--archs llama,gemma3,...] [--pairs 5] [--problems 30] [--json]

1. Random models (every RoPE architecture kvgraft ships, fp32, C=16): pairs of grafts of different texts,
   composed approximately, against the exact fresh run over the same concatenated tokens: KL divergence of the
   first generated token's distribution, argmax agreement, and whether the greedy continuations are equal.
2. The demo model on its 30-problem exam: each problem's replay graft (its prompt and gold worked solution up to
   `Answer:`) placed after the replay graft of another problem. The answer is decoded from the approximate
   composition and from the exact fresh run over the same tokens; accuracy of both, plus the problem's own graft
   alone (exact) as the reference, and the KL / argmax agreement of the answer's first token.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

ROPE_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma4"]
TEXTS = [
    "The harbour master logs every ship that enters, its cargo and the hour of its arrival. ",
    "In the valley the river bends twice before it reaches the old mill and the stone bridge. ",
    "A recipe for bread: flour, water, salt and yeast, kneaded, rested, shaped and baked hot. ",
    "The committee met on Tuesday to weigh three proposals for the new library wing. ",
    "Stars of the winter sky: Orion, the Pleiades, Sirius low in the south after midnight. ",
    "The ledger shows a balance of forty coins after the spring fair and the wool sale. ",
]
_LEADING_INT = re.compile(r"\s*(-?\d+)")


def random_models(archs: list[str], pairs: int, store: Path) -> dict[str, Any]:
    from kvgraft.core.sampling import SamplingParams
    from kvgraft.engine.engine import Engine
    from kvgraft.engine.verify import measure_composition

    rows = {}
    params = SamplingParams(max_new_tokens=8)
    for arch in archs:
        engine = Engine.load(f"random:{arch}", chunk_size=16, store=str(store / arch))
        grafts = [engine.put(text * 2).id for text in TEXTS]
        results = []
        for index in range(pairs):
            first, second = grafts[index % len(grafts)], grafts[(index + 1) % len(grafts)]
            results.append(measure_composition(engine, [first, second], " So:", params))
        rows[arch] = {
            "pairs": len(results),
            "kl_first_median": statistics.median(r.kl_first for r in results),
            "kl_first_max": max(r.kl_first for r in results),
            "argmax_agree": sum(r.argmax_agree for r in results),
            "continuations_equal": sum(r.tokens_equal for r in results),
        }
    return rows


def _answer(text: str) -> int | None:
    match = _LEADING_INT.match(text)
    return int(match.group(1)) if match else None


def demo_exam(problems: int, store: Path) -> dict[str, Any]:
    from kvgraft.core.sampling import SamplingParams
    from kvgraft.engine.engine import Engine
    from kvgraft.engine.verify import kl_divergence
    from kvgraft.flywheel.problems import exam_problems, prompt_of

    engine = Engine.load("demo", store=str(store / "demo"))
    exam = exam_problems()[:problems]

    def replay(text: str, solution: str) -> str:
        return prompt_of(text) + solution[: solution.rfind("Answer:") + len("Answer:")]

    grafts = [engine.put(replay(p.text, p.solution)).id for p in exam]
    params = SamplingParams(max_new_tokens=6, stop=("\n",))
    correct = {"own graft alone (exact)": 0, "after another graft, exact recompute": 0, "approximate": 0}
    kls, agree = [], 0
    for index, problem in enumerate(exam):
        own, other = grafts[index], grafts[(index + 1) % len(grafts)]
        alone = engine.generate("", graft_id=own, params=params)
        approx = engine.generate("", graft_ids=[other, own], params=params, approximate=True, keep_logits=True)
        exact = engine.run_fresh(approx.receipt.input_tokens, params, keep_logits=True)
        for label, text in (
            ("own graft alone (exact)", alone.text),
            ("after another graft, exact recompute", exact.text),
            ("approximate", approx.text),
        ):
            correct[label] += _answer(text) == problem.answer
        first_a, first_e = approx.generation.step_logits[0], exact.step_logits[0]
        kls.append(kl_divergence(first_e, first_a))
        agree += int(first_a.argmax()) == int(first_e.argmax())
    return {
        "problems": len(exam),
        "correct": correct,
        "kl_first_median": statistics.median(kls),
        "kl_first_max": max(kls),
        "argmax_agree": agree,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--archs", default=",".join(ROPE_ARCHS))
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--problems", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgraft-compose-", dir=".") as tmp:
        result = {
            "random": random_models([a for a in args.archs.split(",") if a], args.pairs, Path(tmp)),
            "demo": demo_exam(args.problems, Path(tmp)),
        }
    if args.json:
        print(json.dumps(result))
        return
    print("approximate composition vs the exact recompute of the same tokens (random models, fp32, C=16)")
    print(f"{'arch':8} {'pairs':>5} {'KL p50':>10} {'KL max':>10} {'argmax agree':>13} {'same continuation':>18}")
    for arch, row in result["random"].items():
        print(
            f"{arch:8} {row['pairs']:>5} {row['kl_first_median']:>10.2e} {row['kl_first_max']:>10.2e} "
            f"{row['argmax_agree']:>9}/{row['pairs']:<3} {row['continuations_equal']:>14}/{row['pairs']:<3}"
        )
    demo = result["demo"]
    n = demo["problems"]
    print(f"\ndemo model, exam of {n}: each problem's replay graft placed after another problem's")
    for label, count in demo["correct"].items():
        print(f"  {label:40} {count:>3}/{n} ({100 * count / n:.1f}%)")
    print(
        f"  first answer token, approximate vs exact: KL p50 {demo['kl_first_median']:.2e}, "
        f"max {demo['kl_first_max']:.2e}; argmax agrees {demo['argmax_agree']}/{n}"
    )


if __name__ == "__main__":
    main()
