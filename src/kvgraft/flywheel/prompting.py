"""Prompt formats: how a problem is put to the model, what ends its answer, and where that answer is read.

`plain` is the demo model's format: `Q:<problem>\\nA:`, a worked solution on one line ending `Answer:N`, stopped
at the newline. `chat` is an instruct model's: the problem as a user message (with an instruction to put the final
answer in `\\boxed{}`, and a system prompt) through the tokenizer's own chat template, the answer read from the
last `\\boxed{...}`, stopped at the model's end of turn.

`make_prompter(format, tokenizer, model_name)` gives a `Prompter`; harvest and bench ask it for the prompt text,
the stop rule, the answer and a replay graft's text, so that neither knows which format it runs. The code rung
asks it for a program instead: `plain` asks `Q:<problem>\nCode:` and takes the one line the model writes (the
demo model is trained to write `print(<expression>)`); `chat` asks for a program in a ```python block. A
`PromptSpec` names a format and its settings without a tokenizer (it travels to Ray workers and into reports).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from kvgraft.core.errors import BadInputError
from kvgraft.core.sampling import SamplingParams
from kvgraft.flywheel.answers import extract_answer, extract_boxed
from kvgraft.flywheel.problems import ANSWER_MARK, STOP, code_prompt_of, prompt_of
from kvgraft.flywheel.sandbox import extract_program

DEFAULT_SYSTEM_PROMPT = "You are a careful mathematician. Reason step by step, then state the final answer."
"""the system message of the chat format unless one is given"""
DEFAULT_BOXED_INSTRUCTION = "Put your final answer within \\boxed{}."
"""appended to each problem in the chat format (the public sets' convention, as MathArena asks it)"""
DEFAULT_CODE_INSTRUCTION = (
    "Write a Python program that computes the answer and prints only the final answer. "
    "Put the whole program in one ```python code block."
)
"""appended to each problem in the chat format's code rung"""
BOX_MARK = "\\boxed{"
"""where a chat replay graft ends: the model continues with the answer and its closing brace"""


class PromptFormat(StrEnum):
    """How problems are put to the model (`--prompt-format`)."""

    PLAIN = "plain"
    """the demo model's `Q:<problem>\\nA:` ... `Answer:N`"""
    CHAT = "chat"
    """the tokenizer's chat template, answers in `\\boxed{}`"""


@dataclass(frozen=True, kw_only=True)
class StopRule:
    """What ends a generation in a format, besides the model's end-of-sequence token and the budget."""

    strings: tuple[str, ...] = ()
    """stop strings, looked for in the decoded text (special tokens are skipped there, so none of them)"""
    token_ids: tuple[int, ...] = ()
    """token ids that end a turn (a chat model's end-of-turn token; its EOS is among them)"""

    def sampling(self, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> SamplingParams:
        """The sampling parameters of one answer under this rule.

        Args:
            max_new_tokens: the budget.
            temperature: 0 for greedy.
            seed: the sampling seed.

        Returns:
            The parameters, with this rule's stop strings and stop token ids (top_p 1).
        """
        return SamplingParams(max_new_tokens, temperature, 1.0, seed, self.strings, self.token_ids)


@dataclass(frozen=True, kw_only=True)
class ChatSettings:
    """The configurable parts of the chat format."""

    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    """None or blank: no system message"""
    instruction: str = DEFAULT_BOXED_INSTRUCTION
    """appended to the problem after a blank line; blank: the problem alone"""
    code_instruction: str = DEFAULT_CODE_INSTRUCTION
    """appended to the problem when the code rung asks for a program"""

    def to_json(self) -> dict[str, Any]:
        """Returns: every field by name."""
        return asdict(self)


class Prompter(Protocol):
    """One prompt format, bound to a tokenizer."""

    @property
    def format(self) -> PromptFormat:
        """Which format this is."""
        ...

    @property
    def stop(self) -> StopRule:
        """What ends an answer."""
        ...

    @property
    def answer_mark(self) -> str:
        """What a replay graft ends with: the model continues with the answer."""
        ...

    def prompt(self, problem: str) -> str:
        """The exact prompt text the model is asked (encoded as a context start, BOS added by the tokenizer)."""
        ...

    def answer(self, output: str) -> str | None:
        """The answer a model's output states, or None."""
        ...

    def replay_text(self, problem: str, solution: str) -> str:
        """A replay graft's text: the prompt and a verified solution, cut right after its last answer mark."""
        ...

    def code_prompt(self, problem: str) -> str:
        """The prompt that asks for a program printing the answer (the code rung)."""
        ...

    def program(self, output: str) -> str | None:
        """The program in a model's answer to `code_prompt`, or None when it wrote none."""
        ...


def _cut_at_mark(solution: str, mark: str, separator: str) -> str:
    """The solution up to and including its last `mark`; the mark is added (after `separator`) when absent."""
    at = solution.rfind(mark)
    return solution[: at + len(mark)] if at >= 0 else f"{solution.rstrip()}{separator}{mark}"


@dataclass(frozen=True)
class PlainPrompter:
    """The demo format (`kvgraft.flywheel.problems.prompt_of`, `Answer:`, one line)."""

    format: PromptFormat = PromptFormat.PLAIN
    stop: StopRule = field(default_factory=lambda: StopRule(strings=STOP))
    answer_mark: str = ANSWER_MARK

    def prompt(self, problem: str) -> str:
        """Returns: `Q:<problem>\\nA:`."""
        return prompt_of(problem)

    def answer(self, output: str) -> str | None:
        """Returns: what follows the last `Answer:` on its line (see `answers.extract_answer`)."""
        return extract_answer(output)

    def replay_text(self, problem: str, solution: str) -> str:
        """Returns: the prompt and the solution up to its last `Answer:` (a new line and the mark when none)."""
        return self.prompt(problem) + _cut_at_mark(solution, ANSWER_MARK, "\n")

    def code_prompt(self, problem: str) -> str:
        """Returns: `Q:<problem>\\nCode:` (the model writes its program on that line)."""
        return code_prompt_of(problem)

    def program(self, output: str) -> str | None:
        """Returns: a fenced ```python block when the output has one, else the output's first line (None when
        blank)."""
        fenced = extract_program(output)
        if fenced is not None:
            return fenced
        line = output.strip().split("\n", 1)[0].strip() if output.strip() else ""
        return line or None


@dataclass(frozen=True)
class ChatPrompter:
    """The chat format: the tokenizer's chat template, answers in `\\boxed{}`, stopped at the end of turn."""

    tokenizer: PreTrainedTokenizerBase
    settings: ChatSettings
    stop: StopRule
    format: PromptFormat = PromptFormat.CHAT
    answer_mark: str = BOX_MARK

    def prompt(self, problem: str) -> str:
        """The problem through the chat template, with the generation prompt (the assistant turn opened).

        The template's own BOS is dropped when the tokenizer adds one when encoding, so that a context never starts
        with two BOS tokens.

        Args:
            problem: the problem text.

        Returns:
            The prompt text.
        """
        return self._rendered(problem, self.settings)

    def _rendered(self, problem: str, settings: ChatSettings) -> str:
        text = _render(self.tokenizer, _messages(problem, settings), generation_prompt=True)
        bos = self.tokenizer.bos_token
        if isinstance(bos, str) and bos and text.startswith(bos) and _adds_bos(self.tokenizer):
            text = text[len(bos) :]
        return text

    def answer(self, output: str) -> str | None:
        """Returns: the content of the last complete `\\boxed{...}` (see `answers.extract_boxed`)."""
        return extract_boxed(output)

    def replay_text(self, problem: str, solution: str) -> str:
        """Returns: the prompt and the solution up to its last `\\boxed{` (a new line and the mark when none)."""
        return self.prompt(problem) + _cut_at_mark(solution, BOX_MARK, "\n")

    def code_prompt(self, problem: str) -> str:
        """Returns: the problem with the code instruction, through the chat template (as `prompt` does)."""
        code = ChatSettings(system_prompt=self.settings.system_prompt, instruction=self.settings.code_instruction)
        return self._rendered(problem, code)

    def program(self, output: str) -> str | None:
        """Returns: the last complete ```python block of the output (see `sandbox.extract_program`)."""
        return extract_program(output)


def make_prompter(
    prompt_format: PromptFormat | str,
    tokenizer: PreTrainedTokenizerBase,
    model_name: str,
    settings: ChatSettings | None = None,
) -> PlainPrompter | ChatPrompter:
    """The prompter of a format for a model.

    Args:
        prompt_format: `plain` or `chat`.
        tokenizer: the model's tokenizer (the chat format needs its chat template).
        model_name: the model as the user named it (for error messages).
        settings: the chat format's system prompt and instruction (defaults: the module's constants).

    Returns:
        The prompter.

    Raises:
        BadInputError: an unknown format, or `chat` for a tokenizer without a chat template.
    """
    kind = _format_of(prompt_format)
    if kind is PromptFormat.PLAIN:
        return PlainPrompter()
    if not getattr(tokenizer, "chat_template", None):
        raise BadInputError(f"model {model_name} has no chat template; use --prompt-format plain")
    return ChatPrompter(tokenizer, settings or ChatSettings(), chat_stop(tokenizer))


@dataclass(frozen=True, kw_only=True)
class PromptSpec:
    """A prompt format and its settings, without a tokenizer: what a run is configured with (and what travels to
    Ray workers and into reports); `bind` makes the prompter."""

    format: PromptFormat = PromptFormat.PLAIN
    settings: ChatSettings = field(default_factory=ChatSettings)

    @classmethod
    def of(cls, prompt_format: str, system_prompt: str | None = None, instruction: str | None = None) -> PromptSpec:
        """The spec of the CLI's `--prompt-format`, `--system-prompt` and `--answer-instruction`.

        Args:
            prompt_format: `plain` or `chat`.
            system_prompt: the chat system message (None: the default; "" for none).
            instruction: what follows each problem in the chat format (None: the default `\\boxed{}` one).

        Returns:
            The spec.

        Raises:
            BadInputError: an unknown format, or chat settings given with the plain format.
        """
        kind = _format_of(prompt_format)
        if kind is PromptFormat.PLAIN and (system_prompt, instruction) != (None, None):
            raise BadInputError("--system-prompt and --answer-instruction go with --prompt-format chat")
        defaults = ChatSettings()
        settings = ChatSettings(
            system_prompt=defaults.system_prompt if system_prompt is None else system_prompt,
            instruction=defaults.instruction if instruction is None else instruction,
        )
        return cls(format=kind, settings=settings)

    def bind(self, tokenizer: PreTrainedTokenizerBase, model_name: str) -> PlainPrompter | ChatPrompter:
        """The prompter for a model (see `make_prompter`)."""
        return make_prompter(self.format, tokenizer, model_name, self.settings)

    def to_json(self) -> dict[str, Any]:
        """Returns: {"format"} for plain, {"format", **settings} for chat."""
        data: dict[str, Any] = {"format": self.format.value}
        return data | self.settings.to_json() if self.format is PromptFormat.CHAT else data


def _format_of(prompt_format: PromptFormat | str) -> PromptFormat:
    try:
        return PromptFormat(prompt_format)
    except ValueError:
        choices = ", ".join(f.value for f in PromptFormat)
        raise BadInputError(f"unknown prompt format {prompt_format!r}; choose one of {choices}") from None


def _messages(problem: str, settings: ChatSettings) -> list[dict[str, str]]:
    user = f"{problem}\n\n{settings.instruction}" if settings.instruction.strip() else problem
    system = settings.system_prompt
    return ([{"role": "system", "content": system}] if system and system.strip() else []) + [
        {"role": "user", "content": user}
    ]


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    """The chat template applied; a template that refuses a system message gets it folded into the user's."""
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    except TemplateError:
        if messages[0]["role"] != "system":
            raise
        # Some templates (Gemma 2's) raise on a system role: its text goes before the user's, as theirs advise.
        folded = [{"role": "user", "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}]
        text = tokenizer.apply_chat_template(folded, add_generation_prompt=generation_prompt, tokenize=False)
    return str(text)


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    bos_id = tokenizer.bos_token_id
    ids = list(tokenizer("x", add_special_tokens=True)["input_ids"])
    return bos_id is not None and bool(ids) and ids[0] == bos_id


def chat_stop(tokenizer: PreTrainedTokenizerBase) -> StopRule:
    """What ends an assistant turn: the special token the template writes right after an assistant message.

    Found by rendering a short conversation and reading the first special token after the assistant's text
    (`<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`); the tokenizer's EOS is added when it differs.

    Args:
        tokenizer: a tokenizer with a chat template.

    Returns:
        The stop rule: those token ids, no stop strings.
    """
    ids: list[int] = []
    end = _end_of_turn(tokenizer)
    if end is not None:
        ids.append(end)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return StopRule(token_ids=tuple(ids))


_PROBE = "kvgraft-probe-answer"


def _end_of_turn(tokenizer: PreTrainedTokenizerBase) -> int | None:
    from jinja2 import TemplateError

    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = _render(tokenizer, messages, generation_prompt=False)
    except TemplateError:
        return None
    after = text[text.rfind(_PROBE) + len(_PROBE) :] if _PROBE in text else ""
    special = {str(added): token_id for token_id, added in tokenizer.added_tokens_decoder.items() if added.special}
    found = [(after.find(token), token_id) for token, token_id in special.items() if token and token in after]
    return int(min(found)[1]) if found else None
