"""Prompt formats, and a random instruct model saved as a local Hugging Face directory (subword BPE tokenizer,
chat template), loaded back offline and run through the engine: generation, exact grafts, replay lookup."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvgraft.core.errors import BadInputError
from kvgraft.core.hashing import sha256_bytes, sha256_token_ids
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_receipt
from kvgraft.flywheel.bench import AnswerPath, Gate, LadderOptions, run_ladder, summarize
from kvgraft.flywheel.datasets import Item
from kvgraft.flywheel.harvest import import_solutions, replay_text
from kvgraft.flywheel.problems import STOP, exam_problems, prompt_of
from kvgraft.flywheel.prompting import (
    DEFAULT_BOXED_INSTRUCTION,
    DEFAULT_SYSTEM_PROMPT,
    ChatPrompter,
    ChatSettings,
    PlainPrompter,
    PromptFormat,
    PromptSpec,
    make_prompter,
)
from kvgraft.flywheel.sandbox import SandboxLimits
from kvgraft.format.metadata import HarvestCost, ReplayMetadata, SolutionSource
from kvgraft.library.library import Library
from kvgraft.models.instruct_fixture import build_instruct_tokenizer, save_random_instruct_model
from kvgraft.models.loading import load_model
from kvgraft.store import LocalStore

from conftest import TEST_CHUNK, cached_model

PROBLEM = exam_problems()[0]


@pytest.fixture(scope="module")
def instruct_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_instruct_model(tmp_path_factory.mktemp("instruct") / "model", seed=0)


@pytest.fixture(scope="module")
def instruct(instruct_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_model(str(instruct_dir))


@pytest.fixture
def engine(instruct: tuple[PreTrainedModel, PreTrainedTokenizerBase], instruct_dir: Path, tmp_path: Path) -> Engine:
    model, tokenizer = instruct
    return Engine(model, tokenizer, str(instruct_dir), TEST_CHUNK, LocalStore(tmp_path / "store"))


def test_plain_is_the_demo_format() -> None:
    prompter = make_prompter("plain", build_instruct_tokenizer(), "any")
    assert isinstance(prompter, PlainPrompter) and prompter.format is PromptFormat.PLAIN
    assert prompter.prompt(PROBLEM.text) == prompt_of(PROBLEM.text) == f"Q:{PROBLEM.text}\nA:"
    assert prompter.stop.strings == STOP and prompter.stop.token_ids == ()
    assert prompter.answer(PROBLEM.solution) == str(PROBLEM.answer)
    item = Item(PROBLEM.id, PROBLEM.text, str(PROBLEM.answer))
    for solution in (PROBLEM.solution, "12+3=15. Answer:15 and more", "no mark here "):
        assert prompter.replay_text(PROBLEM.text, solution) == replay_text(item, solution)


def test_chat_prompt_through_the_template(instruct: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    _, tokenizer = instruct
    prompter = make_prompter("chat", tokenizer, "instruct")
    assert isinstance(prompter, ChatPrompter)
    # The template starts with its own <bos>; the tokenizer adds one when encoding, so the text drops it.
    assert prompter.prompt(PROBLEM.text) == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{PROBLEM.text}\n\n{DEFAULT_BOXED_INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = list(tokenizer(prompter.prompt(PROBLEM.text))["input_ids"])
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert len(ids) < len(prompter.prompt(PROBLEM.text)) / 2  # subword merges, not one token per byte
    custom = make_prompter("chat", tokenizer, "instruct", ChatSettings(system_prompt=None, instruction="Box it."))
    assert custom.prompt("1+1?") == "<|im_start|>user\n1+1?\n\nBox it.<|im_end|>\n<|im_start|>assistant\n"


def test_chat_stop_answer_and_replay_text(instruct: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    _, tokenizer = instruct
    prompter = make_prompter("chat", tokenizer, "instruct")
    assert prompter.stop.strings == ()
    assert prompter.stop.token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),) == (tokenizer.eos_token_id,)
    assert prompter.answer("x=\\boxed{3}, so \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert prompter.answer("Answer:5") is None
    solution = "Half of one is \\boxed{\\frac{1}{2}}."
    assert prompter.replay_text("q", solution) == prompter.prompt("q") + "Half of one is \\boxed{"
    assert prompter.replay_text("q", "It is 4.") == prompter.prompt("q") + "It is 4.\n\\boxed{"


def test_chat_needs_a_chat_template() -> None:
    _, byte_tokenizer = cached_model("random:llama")
    with pytest.raises(BadInputError) as error:
        make_prompter("chat", byte_tokenizer, "random:llama")
    assert str(error.value) == "model random:llama has no chat template; use --prompt-format plain"
    with pytest.raises(BadInputError) as error:
        make_prompter("json", byte_tokenizer, "random:llama")
    assert str(error.value) == "unknown prompt format 'json'; choose one of plain, chat"


def test_a_template_without_system_role_gets_the_system_prompt_in_the_user_turn() -> None:
    tokenizer = build_instruct_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<t>{{ m['role'] }}:{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<t>assistant:{% endif %}"
    )
    prompter = make_prompter("chat", tokenizer, "no-system", ChatSettings(system_prompt="Be brief.", instruction="Box"))
    assert prompter.prompt("2+2?") == "<t>user:Be brief.\n\n2+2?\n\nBox<|im_end|><t>assistant:"
    assert prompter.stop.token_ids == (tokenizer.eos_token_id,)


def test_the_directory_loads_offline_and_is_the_same_for_the_same_seed(
    instruct_dir: Path, instruct: tuple[PreTrainedModel, PreTrainedTokenizerBase], tmp_path: Path
) -> None:
    model, tokenizer = instruct
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tokenizer)
    assert tokenizer.chat_template and tokenizer.decode(tokenizer("héllo ∑ \\boxed{x}")["input_ids"][1:]) == (
        "héllo ∑ \\boxed{x}"
    )
    again = save_random_instruct_model(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256_bytes((again / name).read_bytes()) == sha256_bytes((instruct_dir / name).read_bytes())
    other = save_random_instruct_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (instruct_dir / "model.safetensors").read_bytes()


def test_generation_and_an_exact_graft_of_a_chat_prompt(engine: Engine) -> None:
    prompter = make_prompter("chat", engine.tokenizer, engine.model_name)
    prompt = prompter.prompt(PROBLEM.text)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3)
    fresh = engine.generate(prompt, params=params)
    assert len(fresh.output_tokens) >= 1 and fresh.stop_reason in ("eos", "length")
    put = engine.put(prompt)
    assert put.tokens == len(engine.encode_context(prompt)) > 2 * TEST_CHUNK
    grafted = engine.generate("", graft_id=put.id, params=params)
    assert grafted.output_tokens == fresh.output_tokens and grafted.text == fresh.text
    assert grafted.receipt.logits_chain_sha256 == fresh.receipt.logits_chain_sha256
    assert grafted.generation.prefill_tokens < TEST_CHUNK  # the graft's state was restored, not recomputed
    assert verify_receipt(engine, grafted.receipt).exact


def test_engine_load_from_the_directory(instruct_dir: Path, tmp_path: Path) -> None:
    engine = Engine.load(str(instruct_dir), chunk_size=TEST_CHUNK, store=str(tmp_path / "store"))
    result = engine.generate("<|im_start|>user\nhi<|im_end|>\n", params=SamplingParams(max_new_tokens=4))
    assert verify_receipt(engine, result.receipt).exact


def test_a_replay_graft_is_found_by_problem_hash(engine: Engine) -> None:
    prompter = make_prompter("chat", engine.tokenizer, engine.model_name)
    item = Item(PROBLEM.id, PROBLEM.text, str(PROBLEM.answer))
    solution = f"{PROBLEM.solution.split('. Answer:')[0]}, so \\boxed{{{PROBLEM.answer}}}"
    metadata = ReplayMetadata(
        problem_id=item.id,
        problem_sha256=item.text_sha256,
        prompt_tokens_sha256=sha256_token_ids(engine.encode_context(prompter.prompt(item.problem))),
        answer=item.answer,
        solution=solution,
        source=SolutionSource.MODEL,
        cost=HarvestCost(attempts=1, tokens_generated=10),
    )
    put = engine.put(prompter.replay_text(item.problem, solution), metadata=metadata.to_json())
    library = Library.from_store(engine.store)
    assert library.find_replay_by_problem(item.text_sha256) == put.id
    assert library.find_replay(engine.encode_context(prompter.prompt(item.problem))) == put.id
    assert library.find_replay_by_problem(sha256_bytes(b"another problem")) is None
    # Restored, the replay graft ends at the box: the model continues with the answer alone.
    result = engine.generate("", graft_id=put.id, params=SamplingParams(max_new_tokens=4))
    assert verify_receipt(engine, result.receipt).exact


def test_an_end_of_turn_token_other_than_eos_is_a_stop_token() -> None:
    # Llama 3's shape: turns end with <|eot_id|>, while the tokenizer's EOS is another token.
    tokenizer = build_instruct_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|eot_id|>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    prompter = make_prompter("chat", tokenizer, "llama3-like")
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert eot != tokenizer.eos_token_id
    assert prompter.stop.token_ids == (eot, tokenizer.eos_token_id)


def _boxed_items(n: int) -> list[Item]:
    """Exam problems whose worked solutions end in `\\boxed{N}`, as the public sets write them."""
    return [
        Item(p.id, p.text, str(p.answer), f"{p.solution.split('. Answer:')[0]}, so \\boxed{{{p.answer}}}")
        for p in exam_problems()[:n]
    ]


def test_the_chat_format_through_harvest_and_the_ladder(engine: Engine) -> None:
    items = _boxed_items(3)
    chat = PromptSpec.of("chat")
    records = import_solutions(engine, items[:2], prompt=chat)
    assert [r.verified for r in records] == [True, True]
    manifest = engine.store.manifest(records[0].graft_id or "")
    assert manifest.metadata["prompt_format"] == "chat"
    prompter = chat.bind(engine.tokenizer, engine.model_name)
    assert engine.tokenizer.decode(manifest.tokens, skip_special_tokens=False).endswith("\\boxed{")
    library = Library.from_store(engine.store)
    assert library.find_replay_by_problem(items[0].text_sha256, "chat") == records[0].graft_id
    assert library.find_replay_by_problem(items[0].text_sha256) is None  # not a plain-format graft
    options = LadderOptions(budget=6, prompt=chat, code=SandboxLimits(wall_s=5.0))
    results, facts = run_ladder(engine, items, library, options=options)
    assert [r.grafted.path for r in results] == [AnswerPath.REPLAY, AnswerPath.REPLAY, AnswerPath.BARE]
    assert [r.seen for r in results] == [True, True, False]
    assert facts.receipts.total == facts.receipts.verified == 2 + 3  # replays, and every code answer
    # The chat format stops at the end of turn: a stop token, recorded in every receipt.
    assert all(r.sampling.stop_token_ids == prompter.stop.token_ids for r in facts.receipts.kept)
    summary = summarize(results, 6, facts, Gate(), options=options)
    assert summary.to_json()["prompt"]["format"] == "chat"


def test_a_replay_is_found_by_problem_hash_when_its_prompt_tokens_differ(engine: Engine) -> None:
    # Harvested under another system prompt: the prompt tokens differ, the problem and the format do not.
    items = _boxed_items(1)
    records = import_solutions(engine, items, prompt=PromptSpec.of("chat", system_prompt="Be brief."))
    asked = PromptSpec.of("chat")
    prompter = asked.bind(engine.tokenizer, engine.model_name)
    library = Library.from_store(engine.store)
    assert library.find_replay(engine.encode_context(prompter.prompt(items[0].problem))) is None
    results, facts = run_ladder(engine, items, library, options=LadderOptions(budget=4, prompt=asked))
    assert results[0].grafted.path is AnswerPath.REPLAY and results[0].grafted.graft_id == records[0].graft_id
    assert facts.receipts.verified == 1


def test_prompt_specs_refuse_what_does_not_fit() -> None:
    with pytest.raises(BadInputError, match=r"^unknown prompt format 'xml'; choose one of plain, chat$"):
        PromptSpec.of("xml")
    with pytest.raises(BadInputError, match=r"^--system-prompt and --answer-instruction go with --prompt-format chat$"):
        PromptSpec.of("plain", system_prompt="x")
    spec = PromptSpec.of("chat", system_prompt="", instruction="Answer in \\boxed{}.")
    assert spec.settings.system_prompt == "" and spec.to_json()["instruction"] == "Answer in \\boxed{}."
    assert PromptSpec().to_json() == {"format": "plain"}
