"""A model spec that does not name a loadable causal LM is one clear error line, in the API and in the CLI.

Each bad local directory is built here from tiny configs saved with save_pretrained (a Llama with the project's
BPE instruct tokenizer, a BERT, a DistilBERT); none of them asks the hub (HF_HUB_OFFLINE is set in conftest).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_cli import fails
from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel
from typer.testing import CliRunner, Result

from kvgraft.cli import app
from kvgraft.core.errors import BadInputError, KvgraftError, NotFoundError
from kvgraft.models.instruct_fixture import build_instruct_tokenizer, instruct_config, save_random_instruct_model
from kvgraft.models.loading import is_local_spec, load_model
from kvgraft.models.random_models import build_random_model

runner = CliRunner()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every kind of model directory, good and bad, by name (built once: tiny, but saving takes a moment)."""
    base = tmp_path_factory.mktemp("models")
    good = save_random_instruct_model(base / "instruct")
    no_tokenizer = base / "no-tokenizer"
    build_random_model(instruct_config(build_instruct_tokenizer()), 0, torch.float32).save_pretrained(no_tokenizer)
    # The tokenizer check comes before the weights are read: garbage weights do not change the error.
    garbage_weights = base / "no-tokenizer-garbage-weights"
    shutil.copytree(no_tokenizer, garbage_weights)
    (garbage_weights / "model.safetensors").write_bytes(b"not safetensors")
    bert = base / "bert"
    BertModel(
        BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=64)
    ).save_pretrained(bert)
    distilbert = base / "distilbert"
    DistilBertModel(DistilBertConfig(n_layers=1, dim=16, n_heads=2, hidden_dim=32, vocab_size=64)).save_pretrained(
        distilbert
    )
    no_weights = base / "no-weights"
    shutil.copytree(good, no_weights)
    (no_weights / "model.safetensors").unlink()
    truncated = base / "truncated-weights"
    shutil.copytree(good, truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    no_config = base / "no-config"
    shutil.copytree(good, no_config)
    (no_config / "config.json").unlink()
    bad_config = base / "bad-config"
    shutil.copytree(good, bad_config)
    (bad_config / "config.json").write_text("{not json")
    return {
        "base": base,
        "good": good,
        "no_tokenizer": no_tokenizer,
        "garbage_weights": garbage_weights,
        "bert": bert,
        "distilbert": distilbert,
        "no_weights": no_weights,
        "truncated": truncated,
        "no_config": no_config,
        "bad_config": bad_config,
    }


def expected(dirs: dict[str, Path], case: str) -> tuple[str, type[KvgraftError], str]:
    """(spec, error type, exact message) of each bad case."""
    path = dirs.get(case, dirs["base"] / "missing")
    tokenizer = "has no tokenizer (tokenizer.json or tokenizer_config.json); save the tokenizer beside the weights"
    cases: dict[str, tuple[str, type[KvgraftError], str]] = {
        "missing": (str(path), NotFoundError, f"model directory {path} does not exist"),
        "file": (
            str(dirs["good"] / "config.json"),
            BadInputError,
            f"model {dirs['good'] / 'config.json'} is a file, not a directory; give the directory that holds "
            "config.json",
        ),
        "bert": (
            str(path),
            BadInputError,
            f"model {path} is not a causal language model (its config is BertConfig, an encoder: is_decoder is "
            "false); kvgraft needs one that AutoModelForCausalLM loads as a decoder",
        ),
        "distilbert": (
            str(path),
            BadInputError,
            f"model {path} is not a causal language model (its config is DistilBertConfig); kvgraft needs one that "
            "AutoModelForCausalLM loads",
        ),
        "no_tokenizer": (str(path), BadInputError, f"model directory {path} {tokenizer}"),
        "garbage_weights": (str(path), BadInputError, f"model directory {path} {tokenizer}"),
        "no_weights": (
            str(path),
            BadInputError,
            f"model directory {path} has no weights (model.safetensors or pytorch_model.bin)",
        ),
        "truncated": (
            str(path),
            BadInputError,
            f"model directory {path} has weights that do not load: Error while deserializing header: "
            "incomplete metadata, file not fully covered",
        ),
        "no_config": (
            str(path),
            BadInputError,
            f"model directory {path} has no config.json; it is not a Hugging Face model directory",
        ),
        "bad_config": (
            str(path),
            BadInputError,
            f"model directory {path} has a config.json that does not load: It looks like the config file at "
            f"'{path / 'config.json'}' is not a valid JSON file.",
        ),
    }
    return cases[case]


BAD_CASES = [
    "missing",
    "file",
    "bert",
    "distilbert",
    "no_tokenizer",
    "garbage_weights",
    "no_weights",
    "truncated",
    "no_config",
    "bad_config",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_a_bad_model_directory_is_one_exact_line(dirs: dict[str, Path], case: str) -> None:
    spec, kind, message = expected(dirs, case)
    with pytest.raises(KvgraftError) as caught:
        load_model(spec)
    assert type(caught.value) is kind
    assert str(caught.value) == message
    assert "\n" not in message


def test_a_missing_relative_path_is_local_and_never_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for spec in ("./nope", "models/llama/v1", "../nope", "~/no-such-kvgraft-model"):
        with pytest.raises(NotFoundError) as caught:
            load_model(spec)
        assert str(caught.value) == f"model directory {spec} does not exist"


def test_a_hub_id_that_does_not_load_offline_is_not_found_as_before() -> None:
    with pytest.raises(NotFoundError) as caught:
        load_model("no-such-org/no-such-model")
    assert str(caught.value).startswith(
        "cannot load model 'no-such-org/no-such-model' as a model id (no such local directory; hub access may be "
        "offline): "
    )
    assert "\n" not in str(caught.value)


def test_an_empty_spec_is_bad_input() -> None:
    with pytest.raises(BadInputError) as caught:
        load_model(" ")
    assert str(caught.value) == "model is empty; give a model directory, a hub id, random:<arch> or demo"


def test_a_good_directory_loads_also_through_a_tilde(dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = load_model(str(dirs["good"]))
    assert type(model).__name__ == "LlamaForCausalLM" and len(tokenizer) == model.config.vocab_size
    monkeypatch.setenv("HOME", str(dirs["good"].parent))
    via_home, _ = load_model(f"~/{dirs['good'].name}")
    weights, weights_via_home = model.state_dict(), via_home.state_dict()
    assert weights.keys() == weights_via_home.keys()
    assert all(torch.equal(weights[name], weights_via_home[name]) for name in weights)


@pytest.mark.parametrize(
    ("spec", "local"),
    [
        ("gpt2", False),
        ("Qwen/Qwen2.5-0.5B-Instruct", False),
        ("google/gemma-3-1b-it", False),
        ("/abs/model", True),
        ("./rel", True),
        (".hidden", True),
        ("~/models/x", True),
        ("a/b/c", True),
        ("with space", True),
        ("back\\slash", True),
    ],
)
def test_a_spec_is_local_when_it_looks_like_a_path(spec: str, local: bool) -> None:
    assert is_local_spec(spec) is local


def test_a_hub_shaped_spec_that_exists_here_is_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert is_local_spec("org/name") is True
    assert is_local_spec("org/other") is False


# --- the CLI -----------------------------------------------------------------------------------------------------


def one_error_line(result: Result) -> str:
    """Exit 1, nothing on stdout, no traceback, and exactly one `error:` line on stderr: returns its message."""
    return fails(result).removeprefix("error: ")


@pytest.mark.parametrize("case", BAD_CASES)
def test_cli_generate_with_a_bad_model_is_one_error_line(dirs: dict[str, Path], case: str, tmp_path: Path) -> None:
    spec, _, message = expected(dirs, case)
    result = runner.invoke(app, ["generate", "--model", spec, "--prompt", "hi", "--store", str(tmp_path / "s")])
    assert one_error_line(result) == message


@pytest.mark.parametrize("case", ["missing", "bert", "no_tokenizer"])
def test_cli_build_with_a_bad_model_is_one_error_line(dirs: dict[str, Path], case: str, tmp_path: Path) -> None:
    spec, _, message = expected(dirs, case)
    store = tmp_path / "s"
    result = runner.invoke(app, ["build", "--text", "hello", "--model", spec, "--store", str(store)])
    assert one_error_line(result) == message
    assert not (store / "grafts").exists() or not any((store / "grafts").iterdir())


def test_cli_generate_with_a_good_directory_works(dirs: dict[str, Path], tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["generate", "--model", str(dirs["good"]), "--prompt", "hi", "-n", "2", "--store", str(tmp_path / "s")],
    )
    assert result.exit_code == 0, result.output
