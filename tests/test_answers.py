from __future__ import annotations

import pytest

from kvgraft.flywheel.answers import answers_match, extract_answer, extract_integer_answer


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
