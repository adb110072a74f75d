"""`kvgraft replicate` and the ladder's new options on the command line: the demo model, a random instruct model
saved as a local directory (chat template, BPE tokenizer), and the bad input each refuses in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import cli, fails, ok_json

from kvgraft.flywheel.problems import exam_problems
from kvgraft.models.instruct_fixture import save_random_instruct_model


@pytest.fixture(scope="module")
def instruct_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_instruct_model(tmp_path_factory.mktemp("instruct") / "model", seed=0)


def _boxed_set(path: Path, n: int) -> Path:
    rows = [
        {"problem": p.text, "answer": str(p.answer), "solution": f"{p.solution}, so \\boxed{{{p.answer}}}"}
        for p in exam_problems()[:n]
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_replicate_on_the_demo_model_runs_the_four_rungs(tmp_path: Path) -> None:
    out = tmp_path / "report"
    data = ok_json(
        cli(
            "replicate",
            "--model",
            "demo",
            "--dataset",
            "demo",
            "--limit",
            "4",
            "--attempts",
            "2",
            "--out",
            out,
            "--json",
        )
    )
    assert list(data["rungs"]) == ["bare", "code", "grafted", "gated"]
    assert data["harvest"]["problems"] == 4 and data["budget"] == 32768  # cut to the demo model's window per answer
    assert sum(data["code_outcomes"].values()) == 4
    assert data["receipts"]["verified"] == data["receipts"]["total"] >= 4  # at least every code answer's
    seen = data["rungs"]["bare"]["seen"]["n"]
    assert seen == data["harvest"]["verified"] and data["rungs"]["bare"]["all"]["n"] == 4
    assert (out / "report.md").is_file() and (out / "ladder.png").is_file() and (out / "store").is_dir()
    assert len(list((out / "receipts").iterdir())) == data["receipts"]["total"]


def test_replicate_on_an_instruct_model_uses_its_chat_template(instruct_dir: Path, tmp_path: Path) -> None:
    dataset = _boxed_set(tmp_path / "set.jsonl", 2)
    out = tmp_path / "report"
    data = ok_json(
        cli(
            "replicate",
            "--model",
            instruct_dir,
            "--dataset",
            dataset,
            "--attempts",
            "1",
            "--budget",
            "8",
            "--samples",
            "2",
            "--out",
            out,
            "--json",
        )
    )
    assert data["prompt"]["format"] == "chat" and data["samples"] == 2 and data["temperature"] == 0.6
    assert data["rungs"]["bare"]["all"]["problems"] == 2 and data["rungs"]["bare"]["all"]["n"] == 4
    assert 0.0 <= data["rungs"]["bare"]["all"]["pass_at_k"] <= 1.0
    assert data["receipts"]["verified"] == data["receipts"]["total"]
    assert "pass@k" in (out / "report.md").read_text()


def test_harvest_and_bench_in_the_chat_format(instruct_dir: Path, tmp_path: Path) -> None:
    dataset = _boxed_set(tmp_path / "set.jsonl", 2)
    chat = ("--model", instruct_dir, "--store", tmp_path / "store", "--prompt-format", "chat", "--system-prompt", "")
    harvested = ok_json(cli("harvest", "--solutions", dataset, *chat, "--no-blocks", "--json"))
    assert harvested["verified"] == 2
    data = ok_json(
        cli("bench", "--dataset", dataset, *chat, "--budget", 4, "--no-code", "--out", tmp_path / "r", "--json")
    )
    assert list(data["rungs"]) == ["bare", "grafted", "gated"]
    assert [p["grafted"]["path"] for p in data["problems"]] == ["replay", "replay"]
    assert data["receipts"] == {"total": 2, "verified": 2}


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("bench", "--prompt-format", "chat"), ("model demo has no chat template; use --prompt-format plain",)),
        (("bench", "--prompt-format", "xml"), ("unknown prompt format 'xml'; choose one of plain, chat",)),
        (("harvest", "--system-prompt", "x"), ("--system-prompt and --answer-instruction go with --prompt-format",)),
        (("bench", "--samples", "2", "--bench-temperature", "0"), ("--samples above 1 needs --bench-temperature",)),
        (("replicate", "--prompt-format", "chat", "--limit", "1"), ("model demo has no chat template",)),
        (("replicate", "--model", "./no/such/model"), ("model directory", "does not exist")),
        (("replicate", "--device", "tpu"), ("unknown device 'tpu'",)),
    ],
)
def test_bad_input_is_one_line(args: tuple[str, ...], fragments: tuple[str, ...], tmp_path: Path) -> None:
    places = ("--store", tmp_path / "s") + (("--out", tmp_path / "r") if args[0] != "harvest" else ())
    fails(cli(*args, *places), *fragments)
