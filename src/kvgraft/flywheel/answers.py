"""Final answers: extraction from model output and checking against gold answers.

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
