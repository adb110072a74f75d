"""A deterministic family of arithmetic word problems with integer answers and worked solutions.

Each problem starts from a count and applies 2-4 events: gains, losses, or k bags of m added or removed (a bag
event is two written steps: k*m, then the add or subtract). The worked solution writes every step, then
`Answer:N`. Difficulty raises the number of events and the size of the numbers. Each problem also has a one-line
Python program that prints its answer (`print(34+3*5-2)`: the start, then each event in story order), the
target after `Code:` for the code skill.

The demo exam (30 problems, AIME-sized) comes from its own seed; training problems come from other seeds and
skip any problem whose text hash is in the exam, so the two never overlap.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvgraft.core.hashing import Sha256Hex, sha256_bytes

EXAM_SEED = 20251130
EXAM_SIZE = 30
ANSWER_MARK = "Answer:"
CODE_MARK = "Code:"
"""what follows the question when the model is asked for a program instead of a worked solution"""
STOP = ("\n",)
"""what ends a worked solution and an answer: the model writes each on one line"""

_NAMES = ["Ada", "Ben", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lu", "Max", "Ned", "Oli", "Pam"]
_ITEMS = ["cards", "coins", "apples", "pens", "stamps", "shells", "beads", "books", "eggs", "nuts", "rocks", "cups"]
_GAIN = ["Gets", "Finds", "Buys", "Wins"]
_LOSE = ["Loses", "Uses", "Sells", "Gives away"]
_BAGS = ["boxes", "bags", "packs", "jars"]


@dataclass(frozen=True)
class Problem:
    id: str
    text: str
    answer: int
    solution: str
    """Worked steps ending in `Answer:N` (no trailing newline)."""
    program: str = ""
    """One line `print(<expr>)` whose printed value is the answer (no trailing newline); last, with a default, so
    problems built without one keep working."""

    @property
    def text_sha256(self) -> Sha256Hex:
        """SHA-256 of the problem text's UTF-8 bytes (what marks a problem seen)."""
        return sha256_bytes(self.text.encode())


@dataclass(frozen=True)
class Event:
    """A change of the count: `amount` items, or `bags` containers of `amount` items each (bags > 0)."""

    gain: bool
    amount: int
    bags: int
    verb_index: int
    container: str


@dataclass(frozen=True)
class Story:
    name: str
    item: str
    start: int
    events: tuple[Event, ...]


def prompt_of(text: str) -> str:
    """The exact prompt the model is asked for a problem.

    Args:
        text: the problem text.

    Returns:
        `Q:<problem>\\nA:`.
    """
    return f"Q:{text}\nA:"


def code_prompt_of(text: str) -> str:
    """The exact prompt the model is asked for a program that prints a problem's answer.

    Args:
        text: the problem text.

    Returns:
        `Q:<problem>\\nCode:`; the model's answer is the program line, then a newline.
    """
    return f"Q:{text}\n{CODE_MARK}"


def render(story: Story, problem_id: str = "") -> Problem:
    """Write a story out as a problem; a loss larger than the count becomes a gain, so counts stay >= 0.

    Args:
        story: the story.
        problem_id: the problem's id.

    Returns:
        The problem: its text, integer answer, worked solution and program.
    """
    value = story.start
    sentences = [f"{story.name} has {value} {story.item}."]
    steps: list[str] = []
    # The program takes each sign from the same gain/loss decision as the text, so it computes the same answer.
    terms = [str(value)]
    for event in story.events:
        delta = event.amount * event.bags if event.bags else event.amount
        gain = event.gain or value < delta
        verbs = (_GAIN[:2] if event.bags else _GAIN) if gain else _LOSE
        verb = verbs[event.verb_index % len(verbs)]
        if event.bags:
            sentences.append(f"{verb} {event.bags} {event.container} of {event.amount}.")
            steps.append(f"{event.bags}*{event.amount}={delta}")
        else:
            sentences.append(f"{verb} {event.amount}.")
        new = value + delta if gain else value - delta
        sign = "+" if gain else "-"
        steps.append(f"{value}{sign}{delta}={new}")
        terms.append(f"{sign}{event.bags}*{event.amount}" if event.bags else f"{sign}{event.amount}")
        value = new
    sentences.append(f"How many {story.item} now?")
    solution = ", ".join(steps) + f". {ANSWER_MARK}{value}"
    return Problem(problem_id, " ".join(sentences), value, solution, f"print({''.join(terms)})")


def draw_story(rng: random.Random, difficulty: int = 1) -> Story:
    """Draw a random story.

    Args:
        rng: the source of randomness (the draw is deterministic given its state).
        difficulty: 1: 2-3 events, numbers below 60; 2: 3-4 events, larger numbers.

    Returns:
        The story.
    """
    n_events = rng.randint(2, 3) if difficulty <= 1 else rng.randint(3, 4)
    events = []
    for _ in range(n_events):
        bags = rng.randint(2, 5) if rng.random() < 1 / 3 else 0
        amount = rng.randint(2, 9) if bags else rng.randint(2, 19 if difficulty <= 1 else 39)
        events.append(Event(rng.random() < 0.5, amount, bags, rng.randrange(4), rng.choice(_BAGS)))
    start = rng.randint(10, 59 if difficulty <= 1 else 99)
    return Story(rng.choice(_NAMES), rng.choice(_ITEMS), start, tuple(events))


def near_miss(story: Story, rng: random.Random) -> Story:
    """The same story with one number changed: reading the original's solution would give a wrong answer.

    Args:
        story: the original story.
        rng: picks the number and the change.

    Returns:
        The changed story.
    """
    which = rng.randrange(len(story.events) + 1)
    if which == len(story.events):
        return replace(story, start=story.start + rng.choice([-3, -2, -1, 1, 2, 3]))
    events = list(story.events)
    event = events[which]
    events[which] = replace(event, amount=max(2, event.amount + rng.choice([-2, -1, 1, 2])) + (event.amount <= 2))
    return replace(story, events=tuple(events))


def exam_stories(size: int = EXAM_SIZE, difficulty: int = 1) -> list[Story]:
    """The exam's stories, drawn from EXAM_SEED.

    Args:
        size: how many (distinct texts).
        difficulty: as in `draw_story`.

    Returns:
        The stories, in exam order.
    """
    rng = random.Random(EXAM_SEED)
    stories: list[Story] = []
    texts: set[str] = set()
    while len(stories) < size:
        story = draw_story(rng, difficulty)
        text = render(story).text
        if text not in texts:
            texts.add(text)
            stories.append(story)
    return stories


def exam_problems(size: int = EXAM_SIZE, difficulty: int = 1) -> list[Problem]:
    """The exam (30 problems by default: the demo's).

    Args:
        size: how many problems.
        difficulty: as in `draw_story`.

    Returns:
        The problems, with ids `exam-00`, `exam-01`, ...
    """
    return [render(story, f"exam-{i:02d}") for i, story in enumerate(exam_stories(size, difficulty))]


def training_stories(seed: int, count: int, difficulty: int = 1) -> list[Story]:
    """Training stories, none of whose text hash is an exam problem's.

    Args:
        seed: the draw's seed.
        count: how many.
        difficulty: as in `draw_story`.

    Returns:
        The stories.
    """
    exam = {p.text_sha256 for p in exam_problems(difficulty=difficulty)}
    rng = random.Random(seed)
    stories: list[Story] = []
    while len(stories) < count:
        story = draw_story(rng, difficulty)
        if render(story).text_sha256 not in exam:
            stories.append(story)
    return stories


def training_problems(seed: int, count: int, difficulty: int = 1) -> list[Problem]:
    """Training problems (`training_stories`, written out).

    Args:
        seed: the draw's seed.
        count: how many.
        difficulty: as in `draw_story`.

    Returns:
        The problems, with ids `train-<seed>-<i>`.
    """
    return [render(story, f"train-{seed}-{i}") for i, story in enumerate(training_stories(seed, count, difficulty))]
