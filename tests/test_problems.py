from __future__ import annotations

import contextlib
import io
import random
import re
import subprocess
import sys

from kvgraft.flywheel.problems import (
    CODE_MARK,
    EXAM_SIZE,
    Event,
    Problem,
    Story,
    code_prompt_of,
    exam_problems,
    near_miss,
    render,
    training_problems,
    training_stories,
)


def test_generator_is_deterministic_across_processes() -> None:
    code = "from kvgraft.flywheel.problems import exam_problems; print([p.text_sha256 for p in exam_problems()])"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == str([p.text_sha256 for p in exam_problems()])
    assert training_problems(5, 50) == training_problems(5, 50)


def test_worked_solutions_compute_the_answer() -> None:
    for problem in exam_problems() + training_problems(3, 200):
        steps = problem.solution.rsplit(". Answer:", 1)[0].split(", ")
        for step in steps:
            expression, result = step.split("=")
            assert eval(expression) == int(result)
        assert int(steps[-1].split("=")[1]) == problem.answer >= 0
        assert problem.solution.endswith(f"Answer:{problem.answer}")


def test_exam_and_training_never_overlap() -> None:
    exam = exam_problems()
    assert len(exam) == EXAM_SIZE == len({p.text_sha256 for p in exam})
    exam_hashes = {p.text_sha256 for p in exam}
    # The trainer draws pools of 512 from seeds 1001, 1002, ... (the shipped model used fewer than 100 pools) and
    # drops any near miss whose hash is an exam problem's; check every pool it can have used, by hash.
    for seed in range(1001, 1101):
        assert not exam_hashes & {p.text_sha256 for p in training_problems(seed, 512)}


def test_near_miss_changes_the_answer_or_the_text() -> None:
    rng = random.Random(0)
    for story in training_stories(7, 100):
        other = near_miss(story, rng)
        assert render(other).text != render(story).text


_PROGRAM = re.compile(r"^print\(([0-9+\-*]+)\)$")


def test_programs_print_the_answer() -> None:
    for problem in exam_problems() + training_problems(3, 500):
        match = _PROGRAM.match(problem.program)
        assert match is not None, problem.program
        assert eval(match.group(1)) == problem.answer
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(problem.program, {"__builtins__": {"print": print}})
        assert printed.getvalue() == f"{problem.answer}\n"


def test_program_follows_the_story_and_its_signs() -> None:
    story = Story("Ada", "cards", 34, (Event(True, 5, 3, 0, "bags"), Event(False, 2, 0, 0, "bags")))
    assert render(story).program == "print(34+3*5-2)"
    # A loss larger than the count is written as a gain, in the text, the solution and the program alike.
    story = Story("Ada", "cards", 10, (Event(False, 12, 0, 1, "bags"), Event(False, 4, 2, 0, "jars")))
    problem = render(story)
    assert problem.text == "Ada has 10 cards. Finds 12. Loses 2 jars of 4. How many cards now?"
    assert problem.program == "print(10+12-2*4)"
    assert problem.answer == 14


def test_code_prompt() -> None:
    assert code_prompt_of("Ada has 3 pens. How many pens now?") == "Q:Ada has 3 pens. How many pens now?\nCode:"
    assert code_prompt_of("x").endswith(CODE_MARK)
    assert Problem("id", "text", 1, "Answer:1").program == ""
