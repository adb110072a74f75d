"""kvgraft owns its thread count: the default and its overrides, the switch to a graft's count (exact, bit for bit,
and scoped to the run), refusal of grafts that disagree, and the server's worker thread pinning its own count."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core import reproducibility
from kvgraft.core.errors import BadInputError, EnvironmentMismatchError
from kvgraft.core.sampling import SamplingParams
from kvgraft.server.worker import ModelWorker
from kvgraft.store import LocalStore

from conftest import TEST_CHUNK, TEXT, EngineFactory

# The demo model's fp32 attention gives other bits at 1 and 2 threads over this text (200 tokens), so a run at
# the wrong count cannot pass for the right one.
MODEL = "demo"
PROMPT = " Then"
PARAMS = SamplingParams(max_new_tokens=6)
runner = CliRunner()


@pytest.fixture(autouse=True)
def _threads_back() -> Iterator[None]:
    """Each test leaves torch at the count it found (the CLI and `restore` switch it for the process)."""
    before = reproducibility.current_threads()
    yield
    reproducibility.set_threads(before)


def _clean_env(**env: str) -> dict[str, str]:
    names = {reproducibility.THREADS_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
    return {k: v for k, v in os.environ.items() if k not in names} | {"HF_HUB_OFFLINE": "1"} | env


def _python(code: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(**env), capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


# --- the count a run uses -----------------------------------------------------------------------------------------


def test_the_default_is_half_the_cpus_at_least_one_at_most_four() -> None:
    assert [reproducibility.default_threads(cpus) for cpus in (1, 2, 3, 4, 6, 8, 16, 192)] == [1, 1, 1, 2, 3, 4, 4, 4]


def test_an_explicit_count_beats_the_environment_which_beats_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(reproducibility.THREADS_ENV, raising=False)
    assert reproducibility.requested_threads() == reproducibility.default_threads()
    monkeypatch.setenv(reproducibility.THREADS_ENV, "3")
    assert reproducibility.requested_threads() == 3
    assert reproducibility.requested_threads(5) == 5
    monkeypatch.setenv(reproducibility.THREADS_ENV, "many")
    with pytest.raises(BadInputError) as raised:
        reproducibility.requested_threads()
    assert str(raised.value) == "$KVGRAFT_THREADS must be an integer from 1 to 1024, got 'many'"


def test_importing_kvgraft_pins_its_count() -> None:
    probe = "import kvgraft, torch; from kvgraft.core import reproducibility as r; print(torch.get_num_threads())"
    default = _python(probe.replace("print(torch", "print(r.default_threads(), torch"))
    assert default.split() == [default.split()[0]] * 2  # no setting: kvgraft's default, not torch's
    assert _python(probe, KVGRAFT_THREADS="3") == "3"


def test_a_malformed_env_var_is_no_import_error_and_omp_num_threads_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(reproducibility.THREADS_ENV, "oops")
    reproducibility.configure()  # what importing kvgraft runs: the CLI reports the bad value, not the import
    assert torch.get_num_threads() == reproducibility.default_threads()
    monkeypatch.delenv(reproducibility.THREADS_ENV)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    reproducibility.set_threads(2)  # torch read OMP_NUM_THREADS when it started: stands for that count
    assert reproducibility.requested_threads() == 2


def test_threads_switches_for_the_body_only() -> None:
    before = reproducibility.current_threads()
    with reproducibility.threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


# --- grafts made with another count ---------------------------------------------------------------------------


_CONTINUE = """
import json, sys, torch
from pathlib import Path
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.store import LocalStore
engine = Engine.load("demo", chunk_size={chunk}, store=LocalStore(Path(sys.argv[1])))
result = engine.generate({prompt!r}, graft_id=sys.argv[2], params=SamplingParams(max_new_tokens={n}))
print(json.dumps({{
    "chain": result.receipt.logits_chain_sha256,
    "input_tokens": result.receipt.input_tokens,
    "exact": result.exact,
    "receipt_threads": result.receipt.fingerprint.environment["threads"],
    "threads_after": torch.get_num_threads(),
}}))
"""


def test_a_graft_made_at_2_threads_is_continued_exactly_by_a_process_at_1(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    engine = make_engine(MODEL)
    with reproducibility.threads(2):
        put = engine.put(TEXT)
    manifest = store.manifest(put.id)
    assert manifest.fingerprint.environment["threads"] == 2
    code = _CONTINUE.format(chunk=TEST_CHUNK, prompt=PROMPT, n=PARAMS.max_new_tokens)
    done = subprocess.run(
        [sys.executable, "-c", code, str(store.root), put.id],
        env=_clean_env(KVGRAFT_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grafted = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = list(manifest.tokens) + engine.encode_continuation(PROMPT)
    assert grafted["input_tokens"] == tokens
    with reproducibility.threads(2):
        fresh_at_2 = engine.run_fresh(tokens, PARAMS).logits_chain
    with reproducibility.threads(1):
        fresh_at_1 = engine.run_fresh(tokens, PARAMS).logits_chain
    assert grafted["chain"] == fresh_at_2  # bit for bit the fresh run at the graft's count
    assert fresh_at_1 != fresh_at_2  # control: the process's own count would have given other bits
    assert grafted["exact"] is True and grafted["receipt_threads"] == 2
    assert grafted["threads_after"] == 1  # the switch lasted for the run only


def test_generate_switches_for_the_run_and_records_the_count(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    with reproducibility.threads(2):
        put = engine.put(TEXT)
    reproducibility.set_threads(1)
    result = engine.generate(PROMPT, graft_id=put.id, params=PARAMS)
    assert result.exact and result.receipt.environment_differences == []
    assert result.receipt.fingerprint.environment["threads"] == 2
    assert torch.get_num_threads() == 1 and engine.fingerprint.environment["threads"] == 1
    bare = engine.generate(PROMPT, params=PARAMS)
    assert bare.receipt.fingerprint.environment["threads"] == 1


def test_restore_switches_to_the_graft_count_and_stays(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    with reproducibility.threads(2):
        put = engine.put(TEXT)
    reproducibility.set_threads(1)
    restored = engine.restore(put.id)
    assert restored.environment_differences == []
    assert torch.get_num_threads() == 2  # the restored cache is continued at the graft's count


def test_a_child_is_built_at_its_parent_count_and_shares_its_blocks(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    with reproducibility.threads(1):
        parent = engine.put(TEXT)
    with reproducibility.threads(2):
        child = engine.put(" And one more sentence after it, to make new blocks.", after=parent.id)
    parents, children = (engine.store.manifest(g) for g in (parent.id, child.id))
    assert children.fingerprint.environment["threads"] == 1
    shared = len(parents.blocks)
    assert [b.key for b in children.blocks[:shared]] == [b.key for b in parents.blocks]
    result = engine.generate(PROMPT, graft_ids=[parent.id, child.id], params=PARAMS)
    assert result.exact and result.receipt.fingerprint.environment["threads"] == 1


def test_grafts_made_with_different_counts_are_refused_together(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    with reproducibility.threads(1):
        one = engine.put(TEXT)
    with reproducibility.threads(2):
        two = engine.put("A second text about something else entirely, long enough for a block or two.")
    with pytest.raises(EnvironmentMismatchError) as raised:
        engine.generate(PROMPT, graft_ids=[one.id, two.id], params=PARAMS, approximate=True)
    assert str(raised.value) == (
        f"the grafts were made with different thread counts ({one.id[:12]} 1, {two.id[:12]} 2); one run computes "
        "with one count, so they cannot be used together exactly"
    )
    lenient = make_engine("random:llama", allow_environment_mismatch=True)
    result = lenient.generate(PROMPT, graft_ids=[one.id, two.id], params=PARAMS, approximate=True)
    assert result.receipt.fingerprint.environment["threads"] == 2  # the last graft's count
    assert result.receipt.environment_differences == ["threads 1 vs 2"]


def test_other_environment_differences_are_still_refused(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    with reproducibility.threads(2):
        put = engine.put(TEXT)
    other = make_engine("random:llama")
    loaded = other.fingerprint
    other.__dict__["_loaded_fingerprint"] = type(loaded)(
        loaded.model, loaded.schedule, loaded.environment | {"cpu_capability": "NONE"}
    )
    with pytest.raises(EnvironmentMismatchError, match=r"cpu_capability '.+' vs 'NONE'\)"):
        other.generate(PROMPT, graft_id=put.id, params=PARAMS)


# --- the server's worker thread ---------------------------------------------------------------------------------


def test_the_server_worker_computes_with_its_own_count(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    with reproducibility.threads(2):
        put = engine.put(TEXT)
    worker = ModelWorker(engine, max_queue=2, threads=3)
    inherited = ModelWorker(engine, max_queue=2)  # the count of the thread that made it

    async def scenario() -> list[Any]:
        worker.start()
        inherited.start()
        try:
            seen = [await worker.run(lambda _: torch.get_num_threads())]
            generated = await worker.run(lambda e: e.generate(PROMPT, graft_id=put.id, params=PARAMS))
            seen.append(generated.receipt.fingerprint.environment["threads"])
            seen.append(await worker.run(lambda _: torch.get_num_threads()))  # back to its own after the graft
            seen.append(await inherited.run(lambda _: torch.get_num_threads()))
            return seen
        finally:
            worker.close()
            inherited.close()

    assert asyncio.run(scenario()) == [3, 2, 3, reproducibility.current_threads()]


# --- the command line -------------------------------------------------------------------------------------------


def _cli(*args: Any, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(app, [str(a) for a in args], env=env)


def test_the_threads_option_and_env_var(tmp_path: Path) -> None:
    store = tmp_path / "store"
    common = ("--model", "random:llama", "--store", store, "--chunk-size", TEST_CHUNK, "--json")
    built = _cli("build", "--text", TEXT, "--threads", "2", *common)
    assert built.exit_code == 0, built.output
    gid = json.loads(built.stdout)["id"]
    assert LocalStore(store).manifest(gid).fingerprint.environment["threads"] == 2
    receipt = tmp_path / "receipt.json"
    generated = _cli(
        *("generate", "-g", gid, "-p", PROMPT, "-n", 3, "--receipt", receipt, "--store", store, "--json"),
        env={"KVGRAFT_THREADS": "1"},
    )
    assert generated.exit_code == 0, generated.output
    assert json.loads(generated.stdout)["exact"] is True
    assert json.loads(receipt.read_text())["fingerprint"]["environment"]["threads"] == 2
    assert torch.get_num_threads() == 1  # the command's own count, after the run at the graft's
    refused = _cli("generate", "-p", "x", "--threads", "0", "--store", store)
    assert refused.exit_code == 1 and refused.stderr.startswith(
        "error: Invalid value for '--threads' (env var: 'KVGRAFT_THREADS'): Input should be greater than or equal to 1"
    )
    refused = _cli("generate", "-p", "x", "--store", store, env={"KVGRAFT_THREADS": "many"})
    assert refused.exit_code == 1 and "unable to parse string as an integer" in refused.stderr
