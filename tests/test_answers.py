from __future__ import annotations

import pytest

from kvgraft.flywheel.answers import answers_match, extract_answer, extract_boxed, extract_integer_answer


@pytest.mark.parametrize(
    ("gold", "predicted", "expected"),
    [
        (70, "070", True),
        ("70", "70", True),
        ("588", "589", False),
        ("27.0", "27", True),
        ("\\frac{3}{4}", "0.75", True),
        ("\\frac{3}{4}", "\\dfrac{3}{4}", True),
        ("\\frac{3}{4}", "\\frac{4}{3}", False),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})", True),
        ("10", None, False),
        ("10", "", False),
        ("0.5", "\\frac{1}{2}", True),
        ("\\frac{1}{2}", "0.5", True),
        ("70", "070", True),
        ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ],
)
def test_answers_match(gold: object, predicted: object, expected: bool) -> None:
    assert answers_match(gold, predicted) is expected


def test_extraction() -> None:
    assert extract_integer_answer("3*4=12, 24-12=12. Answer:12") == 12
    assert extract_integer_answer("Answer:7 then Answer:070") == 70
    assert extract_integer_answer("no mark") is None
    assert extract_answer("so. Answer: \\frac{1}{2}\nQ:next") == "\\frac{1}{2}"
    assert extract_answer("Answer:") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{70}.", "70"),
        ("\\boxed{1} first, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box, nested braces
        ("\\boxed{\\left\\{ 1, 2 \\right\\}}", "\\left\\{ 1, 2 \\right\\}"),
        ("\\boxed{\\left\\{ 1 \\right.}", "\\left\\{ 1 \\right."),  # escaped braces are the set's
        ("\\fbox{12}", "12"),
        ("\\boxed{3} and \\fbox{4}", "4"),
        ("\\boxed {  9 }", "9"),
        ("\\boxed{5} then cut off \\boxed{\\frac{1}{", "5"),  # a box left open does not count
        ("\\boxed{\\frac{1}{", None),
        ("\\boxed{ }", None),
        ("Answer:7", None),
        ("\\boxed", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_boxed_answers_checked_with_math_verify() -> None:
    assert answers_match("0.5", extract_boxed("We get \\boxed{\\frac{1}{2}}."))
    assert answers_match(70, extract_boxed("\\boxed{070}"))
    assert not answers_match("71", extract_boxed("\\boxed{070}"))
    assert not answers_match("70", extract_boxed("no box: 70"))
