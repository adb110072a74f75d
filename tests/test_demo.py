"""`kvgraft demo --quick` end to end on the shipped demo model, and the model's own facts."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.models.demo_model import demo_weights_sha256, describe


def test_shipped_weights_match_their_recorded_sha256() -> None:
    weights = resources.files("kvgraft").joinpath("data/demo_model/model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == demo_weights_sha256() == describe()["weights_sha256"]
    assert len(weights) <= 20 * 1024 * 1024
    assert describe()["architecture"].startswith("Gemma4")


def test_demo_quick_runs_the_flywheel_and_every_receipt_verifies(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["demo", "--quick", "--json", "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rungs = data["rungs"]
    assert list(rungs) == ["bare", "code", "grafted", "gated"]
    # Every code answer's program ran in the sandbox (or there was none), each outcome counted.
    assert sum(data["code_outcomes"].values()) == 10
    for rung in rungs.values():
        assert set(rung) == {"seen", "unseen", "all"}
        for cell in rung.values():
            assert {"n", "correct", "accuracy", "ci95", "decode_tokens_mean"} <= set(cell)
            assert cell["ci95"][0] <= (cell["accuracy"] or 0) <= cell["ci95"][1]
    seen, unseen = rungs["bare"]["seen"]["n"], rungs["bare"]["unseen"]["n"]
    # The quick harvest verifies some problems (2 of its 10 on this model): the replay claim is always tested.
    assert seen + unseen == 10 and 1 <= seen <= 6 and unseen >= 4
    # Replay restores the verified reasoning: on seen problems only the answer is decoded.
    assert rungs["grafted"]["seen"]["decode_tokens_mean"] * 8 <= rungs["bare"]["seen"]["decode_tokens_mean"]
    assert rungs["grafted"]["seen"]["accuracy"] >= 0.8
    # Receipts: every code answer's and every grafted answer's.
    assert data["receipts"]["total"] >= 10 + seen and data["receipts"]["verified"] == data["receipts"]["total"]
    report = Path(data["report"])
    assert report.is_file() and (report.parent / "ladder.png").is_file() and (report.parent / "tokens.png").is_file()
    assert json.loads((report.parent / "results.json").read_text())["rungs"] == rungs
    # Every grafted answer's receipt is in the report, and re-checks after the run; the store is kept beside it.
    receipts = sorted((report.parent / "receipts").iterdir())
    assert len(receipts) == data["receipts"]["total"]
    checked = CliRunner().invoke(app, ["verify", "--receipt", str(receipts[0]), "--model", "demo", "--json"])
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.stdout)["exact"] is True
    listed = CliRunner().invoke(app, ["ls", "--store", str(report.parent / "store"), "--json"])
    assert {g["id"] for g in json.loads(listed.stdout)["grafts"]} >= set(data["harvest"]["replay_grafts"])


def test_harvest_with_the_demo_model_stores_only_verified_solutions(tmp_path: Path) -> None:
    from kvgraft.engine.engine import Engine
    from kvgraft.flywheel.answers import extract_integer_answer
    from kvgraft.flywheel.datasets import load_dataset
    from kvgraft.flywheel.harvest import harvest

    engine = Engine.load("demo", store=str(tmp_path / "store"))
    items = load_dataset("demo")[:6]
    records = harvest(engine, items, attempts=2, budget=160)
    stored = set(engine.store.ids())
    assert {r.graft_id for r in records if r.graft_id} == stored
    for item, record in zip(items, records, strict=True):
        assert (record.graft_id is not None) == record.verified
        assert record.tokens_generated > 0 and 1 <= record.attempts <= 2
        if record.verified:
            assert extract_integer_answer(record.solution or "") == int(item.answer)
            metadata = engine.store.manifest(record.graft_id or "").metadata
            assert metadata["answer"] == item.answer
            # The cost the graft records is what the same seeds give on any run: no wall time, or ids would differ.
            assert metadata["cost"] == {"attempts": record.attempts, "tokens_generated": record.tokens_generated}
        else:
            assert record.attempts == 2
    # The same seeds on a second store give the same records and the same graft ids (content-addressed, repeatable).
    again = harvest(Engine.load("demo", store=str(tmp_path / "again")), items, attempts=2, budget=160)
    assert [r.graft_id for r in again] == [r.graft_id for r in records]
    assert [(r.attempts, r.tokens_generated, r.solution) for r in again] == [
        (r.attempts, r.tokens_generated, r.solution) for r in records
    ]
