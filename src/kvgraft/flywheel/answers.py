"""Final answers: extraction from model output and checking against gold answers.

Two ways a model states its answer: the demo format's `Answer:N` line, and the `\\boxed{...}` of instruct models
and the public sets (the last complete box counts, nested braces included; `\\fbox{...}` too).
Integers are compared as numbers ("070" equals 70). Other answers (LaTeX fractions, expressions) go through
HuggingFace math-verify, gold first; its signal-based timeouts only work in the main thread, so elsewhere they
are disabled (math-verify logs a warning) and nothing bounds the time: the inputs are short answer strings.
"""

from __future__ import annotations

import re
import threading

from kvgraft.flywheel.problems import ANSWER_MARK

_INTEGER = re.compile(r"^[+-]?\d+$")
_MARKED = re.compile(re.escape(ANSWER_MARK) + r"\s*([+-]?\d+)")


def extract_integer_answer(text: str) -> int | None:
    """The integer a model's output states as its answer.

    Args:
        text: the output.

    Returns:
        The integer after the last `Answer:`, or None when there is none.
    """
    found = _MARKED.findall(text)
    return int(found[-1]) if found else None


def extract_answer(text: str) -> str | None:
    """The answer a model's output states.

    Args:
        text: the output.

    Returns:
        What follows the last `Answer:` up to the end of that line, stripped; None without the mark (or when
        nothing follows it).
    """
    at = text.rfind(ANSWER_MARK)
    if at < 0:
        return None
    answer = text[at + len(ANSWER_MARK) :].split("\n", 1)[0].strip()
    return answer or None


_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`) in a model's output.

    Braces nest (`\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`); a box left open (an output cut by its budget)
    does not count, so an earlier complete one is taken instead.

    Args:
        text: the output.

    Returns:
        The box's content, stripped; None when there is no complete box or its content is blank.
    """
    starts = sorted((at, len(command)) for command in _BOX_COMMANDS for at in _find_all(text, command))
    for at, length in reversed(starts):
        content = _braced(text, at + length)
        if content is not None:
            return content.strip() or None
    return None


def _find_all(text: str, needle: str) -> list[int]:
    found, at = [], text.find(needle)
    while at >= 0:
        found.append(at)
        at = text.find(needle, at + 1)
    return found


def _braced(text: str, at: int) -> str | None:
    """The text inside the balanced braces that open at `at` (after optional spaces), or None when they don't."""
    while at < len(text) and text[at] == " ":
        at += 1
    if at >= len(text) or text[at] != "{":
        return None
    depth, escaped = 0, False
    for end in range(at, len(text)):
        char = text[end]
        if escaped:  # `\\{` and `\\}` are literal braces (a set's), not the box's
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[at + 1 : end]
    return None


def as_integer(value: object) -> int | None:
    """The integer a value spells (`"070"` is 70), or None when its text is not an optional sign and digits."""
    text = str(value).strip()
    return int(text) if _INTEGER.match(text) else None


def answers_match(gold: object, predicted: object) -> bool:
    """Whether a predicted answer equals the gold one.

    Args:
        gold: the gold answer.
        predicted: the predicted answer (None or blank is never right).

    Returns:
        True when they are equal: as integers when both are, else by math-verify (gold first).
    """
    gold_int, predicted_int = as_integer(gold), as_integer(predicted)
    if gold_int is not None and predicted_int is not None:
        return gold_int == predicted_int
    if predicted is None or str(predicted).strip() == "":
        return False
    return _math_verify(str(gold), str(predicted))


def _math_verify(gold: str, predicted: str) -> bool:
    from math_verify import parse, verify

    in_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main else None
    gold_parsed = parse(_wrap(gold), parsing_timeout=timeout)
    predicted_parsed = parse(_wrap(predicted), parsing_timeout=timeout)
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))


def _wrap(answer: str) -> str:
    """math-verify finds answers in LaTeX delimiters; bare expressions are wrapped so they parse as math."""
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
