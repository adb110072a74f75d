"""Bench output: results JSON, a markdown report and PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvgraft.flywheel.bench import RUNGS, SPLITS


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def ladder_table(results: dict[str, Any]) -> list[list[str]]:
    """Rows of rung x split: correct/n, accuracy, 95% CI, decode tokens mean."""
    rows = []
    for rung in RUNGS:
        for split in SPLITS:
            cell = results["rungs"][rung][split]
            lo, hi = cell["ci95"]
            tokens = cell["decode_tokens_mean"]
            rows.append(
                [
                    rung,
                    split,
                    f"{cell['correct']}/{cell['n']}",
                    _pct(cell["accuracy"]),
                    f"[{100 * lo:.0f}, {100 * hi:.0f}]",
                    "n/a" if tokens is None else f"{tokens:.1f}",
                ]
            )
    return rows


def write_report(results: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    receipts = results.pop("receipt_objects", [])
    receipts_dir = out_dir / "receipts"
    receipts_dir.mkdir(exist_ok=True)
    for receipt in receipts:
        (receipts_dir / f"{receipt['id']}.json").write_text(json.dumps(receipt, indent=1, sort_keys=True) + "\n")
    _plot_ladder(results, out_dir / "ladder.png")
    _plot_tokens(results, out_dir / "tokens.png")
    results["report"] = str((out_dir / "report.md").resolve())
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "report.md").write_text(_markdown(results))
    return out_dir / "report.md"


def _plot_ladder(results: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.26
    for offset, split in enumerate(SPLITS):
        xs: list[float] = []
        ys: list[float] = []
        errs: list[list[float]] = [[], []]
        for i, rung in enumerate(RUNGS):
            cell = results["rungs"][rung][split]
            acc = cell["accuracy"] or 0.0
            xs.append(i + (offset - 1) * width)
            ys.append(100 * acc)
            errs[0].append(100 * (acc - cell["ci95"][0]))
            errs[1].append(100 * (cell["ci95"][1] - acc))
        ax.bar(xs, ys, width, yerr=errs, capsize=3, label=f"{split} (n={results['rungs']['bare'][split]['n']})")
    ax.set_xticks(range(len(RUNGS)), RUNGS)
    ax.set_ylabel("accuracy, % (95% Wilson interval)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{results.get('model', '')} on {results.get('dataset', '')}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_tokens(results: dict[str, Any], path: Path) -> None:
    problems = results["problems"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(problems))
    for rung, marker in (("bare", "o"), ("grafted", "s"), ("gated", "^")):
        ax.scatter(xs, [max(1, p[rung]["decode_tokens"]) for p in problems], marker=marker, s=18, label=rung)
    for i, p in enumerate(problems):
        if p["seen"]:
            ax.axvspan(i - 0.5, i + 0.5, color="0.92", zorder=0)
    ax.set_yscale("log")
    ax.set_xlabel("problem (shaded: seen)")
    ax.set_ylabel("decode tokens (log scale)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# kvgraft bench: {results.get('model', '')} on {results.get('dataset', '')}",
        "",
        "Rungs: **bare** (the model alone); **grafted** (the problem's replay graft, found by prompt hash, which"
        " restores the verified reasoning and decodes only the answer; else the best retrieved context block, then"
        " the problem); **gated** (the grafted answer only when retrieval score and answer confidence pass the"
        f" gate: retrieval score >= {results['gate']['min_match']} and answer confidence >="
        f" {results['gate']['min_confidence']}; else bare). A problem is *seen* when its verified solution is in"
        " the library.",
        "",
        "| rung | split | correct | accuracy | 95% CI | decode tokens / problem | TTFT mean | wall |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in ladder_table(results):
        cell = results["rungs"][row[0]][row[1]]
        ttft = "n/a" if cell["ttft_s_mean"] is None else f"{1000 * cell['ttft_s_mean']:.0f} ms"
        lines.append("| " + " | ".join([*row, ttft, f"{cell['wall_s']:.1f} s"]) + " |")
    ratios = results["bare_over_rung_decode_tokens"]
    up = results["upstream"]
    own = results["block_own_solution"]
    lines += [
        "",
        f"Decode tokens, bare / grafted: seen {_ratio(ratios['seen']['grafted'])}, unseen "
        f"{_ratio(ratios['unseen']['grafted'])}, all {_ratio(ratios['all']['grafted'])}. Token budget per problem: "
        f"{results['budget']} ({results['token_budget_total']} in all).",
        "",
        "## Upstream cost",
        "",
        f"The {up['grafts_used']} replay grafts used here cost {up['harvest_tokens']} generated tokens and "
        f"{up['harvest_wall_s']:.1f} s of harvest (every attempt on those problems, failed attempts"
        f" included), used {up['uses_per_graft']}"
        f" time(s) each: {_num(up['amortized_tokens_per_use'])} tokens per use. On seen problems, grafted decode"
        f" tokens plus that upstream cost: {up['seen_grafted_tokens_including_upstream']}, against "
        f"{up['seen_bare_tokens']} for bare.",
        *_harvest_lines(up.get("harvest_all")),
        "## Reading a worked solution in context (diagnostic)",
        "",
        f"Each seen problem asked after the context block that holds its own verified solution (no replay): "
        f"{own['correct']}/{own['n']} correct ({_pct(own['accuracy'])}), {_num(own['decode_tokens_mean'])} decode"
        " tokens per problem. This measures the model's skill at using a solution in its context; replay does not"
        " need that skill.",
        "",
        "## Run",
        "",
        f"- receipts: {results['receipts']['total']} grafted answers, {results['receipts']['verified']} verified by a"
        " fresh rerun (tokens and chained logits hash equal)",
        f"- energy: {_energy(results['energy'])}",
        f"- wall time of the ladder: {results['wall_s']:.1f} s",
        "",
        "![ladder](ladder.png)",
        "",
        "![tokens](tokens.png)",
        "",
    ]
    return "\n".join(lines)


def _harvest_lines(harvest: dict[str, Any] | None) -> list[str]:
    if not harvest:
        return [""]
    return [
        "",
        f"The whole harvest behind this library, failures included: {harvest['problems_tried']} problems tried,"
        f" {harvest['verified']} verified, {harvest['attempts']} attempts, {harvest['tokens_generated']} generated"
        f" tokens, {harvest['wall_s']:.1f} s (graft building included).",
        "",
    ]


def _energy(energy: dict[str, Any]) -> str:
    return energy["source"] if energy["joules"] is None else f"{energy['joules']:.1f} J ({energy['source']})"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
