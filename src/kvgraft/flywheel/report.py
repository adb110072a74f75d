"""Bench output: results JSON, a markdown report and PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvgraft.flywheel.bench import BenchSummary, Rung, Split, Tally
from kvgraft.flywheel.energy import EnergyReading
from kvgraft.flywheel.harvest import HarvestSummary


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _cells(summary: BenchSummary) -> Iterator[tuple[Rung, Split, Tally]]:
    for rung in summary.rung_order:
        for split in Split:
            yield rung, split, summary.cell(rung, split)


def _row(rung: Rung, split: Split, cell: Tally) -> list[str]:
    lo, hi = cell.ci95
    tokens = cell.decode_tokens_mean
    row = [
        rung.value,
        split.value,
        f"{cell.correct}/{cell.n}",
        _pct(cell.accuracy),
        f"[{100 * lo:.0f}, {100 * hi:.0f}]",
        "n/a" if tokens is None else f"{tokens:.1f}",
    ]
    return [*row, _pct(cell.pass_at_k)] if cell.samples > 1 else row


def ladder_table(summary: BenchSummary) -> list[list[str]]:
    """The ladder as text.

    Args:
        summary: a bench summary.

    Returns:
        One row per rung and split: rung, split, correct/n, accuracy (the mean over samples), 95% CI, decode tokens
        mean, and pass@k when the run had several samples per problem.
    """
    return [_row(rung, split, cell) for rung, split, cell in _cells(summary)]


def write_report(summary: BenchSummary, out_dir: Path) -> BenchSummary:
    """Write results.json, report.md, ladder.png, tokens.png and receipts/<id>.json (every grafted answer's receipt)
    into a directory (created if need be).

    Args:
        summary: a bench summary.
        out_dir: the report directory.

    Returns:
        The summary with `report` set to report.md's absolute path (results.json holds exactly its JSON).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    receipts = out_dir / "receipts"
    receipts.mkdir(exist_ok=True)
    for receipt in summary.receipts.kept:  # each re-checkable later: kvgraft verify --receipt receipts/<id>.json
        receipt.write(receipts / f"{receipt.id}.json")
    _plot_ladder(summary, out_dir / "ladder.png")
    _plot_tokens(summary, out_dir / "tokens.png")
    written = replace(summary, report=str((out_dir / "report.md").resolve()))
    (out_dir / "results.json").write_text(json.dumps(written.to_json(), indent=1) + "\n")
    (out_dir / "report.md").write_text(_markdown(written))
    return written


def _plot_ladder(summary: BenchSummary, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.26
    for offset, split in enumerate(Split):
        xs: list[float] = []
        ys: list[float] = []
        errs: list[list[float]] = [[], []]
        for i, rung in enumerate(summary.rung_order):
            cell = summary.cell(rung, split)
            acc = cell.accuracy or 0.0
            xs.append(i + (offset - 1) * width)
            ys.append(100 * acc)
            errs[0].append(100 * (acc - cell.ci95[0]))
            errs[1].append(100 * (cell.ci95[1] - acc))
        n = summary.cell(Rung.BARE, split).n
        ax.bar(xs, ys, width, yerr=errs, capsize=3, label=f"{split.value} (n={n})")
    ax.set_xticks(range(len(summary.rung_order)), [rung.value for rung in summary.rung_order])
    ax.set_ylabel("accuracy, % (95% interval)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{summary.model or ''} on {summary.dataset or ''}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_tokens(summary: BenchSummary, path: Path) -> None:
    problems = summary.problems
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(problems))
    markers = {Rung.BARE: "o", Rung.CODE: "D", Rung.GRAFTED: "s", Rung.GATED: "^"}
    for rung in summary.rung_order:
        marker = markers[rung]
        ax.scatter(xs, [max(1, p.rung(rung).decode_tokens) for p in problems], marker=marker, s=18, label=rung.value)
    for i, p in enumerate(problems):
        if p.seen:
            ax.axvspan(i - 0.5, i + 0.5, color="0.92", zorder=0)
    ax.set_yscale("log")
    ax.set_xlabel("problem (shaded: seen)")
    ax.set_ylabel("decode tokens (log scale)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _markdown(summary: BenchSummary) -> str:
    gate = summary.gate
    code = (
        " **code** (the model writes a Python program, run in the sandbox; its last printed line is the answer);"
        if Rung.CODE in summary.rungs
        else ""
    )
    sampled = summary.samples > 1
    lines = [
        f"# kvgraft bench: {summary.model or ''} on {summary.dataset or ''}",
        "",
        f"Rungs: **bare** (the model alone);{code} **grafted** (the problem's replay graft, found by prompt hash, which"
        " restores the verified reasoning and decodes only the answer; else the best retrieved context block, then"
        " the problem); **gated** (the grafted answer only when retrieval score and answer confidence pass the"
        f" gate: retrieval score >= {gate.min_match} and answer confidence >="
        f" {gate.min_confidence}; else bare). A problem is *seen* when its verified solution is in"
        " the library.",
        "",
        *_protocol_lines(summary),
        "| rung | split | correct | accuracy | 95% CI | decode tokens / answer |"
        + (" pass@k |" if sampled else "")
        + " TTFT mean | wall |",
        "|---|---|---:|---:|---:|---:|" + ("---:|" if sampled else "") + "---:|---:|",
    ]
    for rung, split, cell in _cells(summary):
        ttft = "n/a" if cell.ttft_s_mean is None else f"{1000 * cell.ttft_s_mean:.0f} ms"
        lines.append("| " + " | ".join([*_row(rung, split, cell), ttft, f"{cell.wall_s:.1f} s"]) + " |")
    lines += _code_lines(summary)
    up = summary.upstream
    own = summary.block_own
    lines += [
        "",
        f"Decode tokens, bare / grafted: seen {_ratio(summary.token_ratio(Split.SEEN, Rung.GRAFTED))}, unseen "
        f"{_ratio(summary.token_ratio(Split.UNSEEN, Rung.GRAFTED))}, all "
        f"{_ratio(summary.token_ratio(Split.ALL, Rung.GRAFTED))}. Token budget per problem: "
        f"{summary.budget} ({summary.token_budget_total} in all).",
        "",
        "## Upstream cost",
        "",
        f"The {up.grafts_used} replay grafts used here cost {up.harvest_tokens} generated tokens and "
        + (f"{up.harvest_wall_s:.1f} s" if up.harvest_wall_s is not None else "an untimed amount")
        + " of harvest (every attempt on those problems, failed attempts"
        f" included), used {up.uses_per_graft}"
        f" time(s) each: {_num(up.amortized_tokens_per_use)} tokens per use. On seen problems, grafted decode"
        f" tokens plus that upstream cost: {up.seen_grafted_tokens_including_upstream}, against "
        f"{up.seen_bare_tokens} for bare.",
        *_harvest_lines(summary.harvest),
        "## Reading a worked solution in context (diagnostic)",
        "",
        f"Each seen problem asked after the context block that holds its own verified solution (no replay): "
        f"{own.correct}/{own.n} correct ({_pct(own.accuracy)}), {_num(own.decode_tokens_mean)} decode"
        " tokens per problem. This measures the model's skill at using a solution in its context; replay does not"
        " need that skill.",
        "",
        "## Run",
        "",
        f"- receipts: {summary.receipts.total} answers ({'code and ' if code else ''}grafted), "
        f"{summary.receipts.verified} verified by a fresh rerun (tokens and chained logits hash equal)",
        f"- energy: {_energy(summary.energy)}",
        f"- wall time of the ladder: {summary.wall_s:.1f} s",
        "",
        "![ladder](ladder.png)",
        "",
        "![tokens](tokens.png)",
        "",
    ]
    return "\n".join(lines)


def _protocol_lines(summary: BenchSummary) -> list[str]:
    """How the answers were asked: the prompt format, and the samples when there were several."""
    prompt = summary.prompt
    lines = []
    if prompt is not None:
        lines.append(f"Prompt format: {prompt.format.value} (the model's chat template, answers in \\boxed{{}}).")
    if summary.samples > 1:
        lines.append(
            f"Each problem answered {summary.samples} times per rung (temperature {summary.temperature:g}, seeds 0.."
            f"{summary.samples - 1}): accuracy is the mean over all answers, its 95% interval is over problems (the"
            f" normal interval of per-problem accuracies), and pass@k is the share of problems answered right at"
            f" least once."
        )
    return [*lines, ""] if lines else []


def _code_lines(summary: BenchSummary) -> list[str]:
    """The code rung's programs counted by how they ended."""
    outcomes = summary.code_outcomes
    if not outcomes:
        return []
    counted = ", ".join(f"{name} {count}" for name, count in sorted(outcomes.items(), key=lambda kv: -kv[1]))
    return [
        "",
        f'Code rung programs by outcome: {counted} (only "ok" gives an answer; the program\'s output is kept'
        " beside each answer in results.json).",
    ]


def _harvest_lines(harvest: HarvestSummary | None) -> list[str]:
    if harvest is None:
        return [""]
    return [
        "",
        f"The whole harvest behind this library, failures included: {harvest.problems} problems tried,"
        f" {harvest.verified} verified, {harvest.attempts} attempts, {harvest.tokens_generated} generated"
        f" tokens, {harvest.wall_s:.1f} s (graft building included).",
        "",
    ]


def _energy(energy: EnergyReading) -> str:
    return energy.source if energy.joules is None else f"{energy.joules:.1f} J ({energy.source})"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
