"""Train the demo model (deterministic, CPU, once; never in CI) and write its weights into the package.

Usage: python scripts/train_demo_model.py [--target-accuracy 0.45] [--max-steps 4000]
                                         [--out src/kvgraft/data/demo_model]

On a machine other processes share, run it with OMP_WAIT_POLICY=PASSIVE in the environment: the same weights
(the thread count and the arithmetic are unchanged), but the two OpenMP threads sleep instead of spinning while
they wait for a busy core, which otherwise makes every step up to ten times slower.

The demo needs a model that is neither hopeless nor perfect (bare pass@1 between 20% and 70%): trained to the
end of a full schedule, this one reaches 96% on held-out problems of its family. So the learning rate is constant
after warmup and training stops at the first evaluation (every --eval-every steps, greedy pass@1 on 100 held-out
problems) that reaches --target-accuracy. The stopping rule is part of the run: the same command stops at the
same step with the same weights.

Data: packed 1024-token sequences of documents about problems from `kvgraft.flywheel.problems.training_stories`
(never an exam problem: checked by text hash). The mix teaches three skills:
- solving: a document `Q:<problem>\\nA:<steps>. Answer:N\\n` is a fresh problem solved step by step;
- using worked solutions earlier in the context: a share of solving documents repeat a problem already solved
  earlier in the same sequence (the right continuation is the verified solution above: copy it), and a share are
  near misses of an earlier problem (one number changed: copying would be wrong, it must be solved);
- writing a program: a share (CODE_SHARE) of all documents are `Q:<problem>\\nCode:<program>\\n`, a fresh problem
  answered by the one line `print(<start><events>)` that prints its answer (the evaluation ladder's code rung).
  Code documents never become earlier solutions: a repeat always has a worked solution above it to copy.
Question tokens get a lower loss weight than solution and program tokens (they are mostly unpredictable names and
numbers, except in repeats, where they teach the model to recognise the repeat).

training.json records, besides the run, greedy solving pass@1 and greedy program pass@1 (the program after
`Code:`, up to a newline, prints the answer; checked here by a pattern match, then `eval` of its arithmetic only)
on the 100 held-out problems and on the exam.

Determinism: fixed seeds for data and weights, one process, torch threads fixed to 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.flywheel.answers import extract_integer_answer
from kvgraft.flywheel.problems import (
    Problem,
    Story,
    code_prompt_of,
    exam_problems,
    near_miss,
    prompt_of,
    render,
    training_problems,
    training_stories,
)
from kvgraft.models.byte_tokenizer import BOS_ID, PAD_ID, build_byte_tokenizer
from kvgraft.models.demo_model import CONTEXT, SHA_FILE, WEIGHTS_FILE, demo_config
from kvgraft.store.local import LocalStore

CODE_SHARE = 0.25
"""share of all documents that are code documents (the rest are solving documents)"""
REPEAT_SHARE = 0.30
"""share of solving documents that repeat an earlier solved problem"""
NEAR_MISS_SHARE = 0.10
"""share of solving documents that are near misses of an earlier solved problem"""
QUESTION_WEIGHT = 0.25
PROGRAM_MAX_TOKENS = 64
# Only the arithmetic the programs use: what passes this may be given to eval (no names, calls or attributes).
_PROGRAM = re.compile(r"^print\(([0-9+\-* ]+)\)$")


def _append(tokenizer: PreTrainedTokenizerBase, tokens: list[int], wts: list[float], question: str, body: str) -> bool:
    """Append one document (the question at QUESTION_WEIGHT, then its body and a newline at full weight) to the
    sequence being packed, if it fits in CONTEXT; returns whether it did."""
    asked = tokenizer(question, add_special_tokens=False)["input_ids"]
    written = tokenizer(body + "\n", add_special_tokens=False)["input_ids"]
    if len(tokens) + len(asked) + len(written) > CONTEXT:
        return False
    tokens.extend(asked + written)
    wts.extend([QUESTION_WEIGHT] * len(asked) + [1.0] * len(written))
    return True


def sequences(seed: int, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields (input_ids, loss_weights) tensors of shape [batch, CONTEXT], forever, deterministically."""
    tokenizer = build_byte_tokenizer()
    rng = random.Random(seed)
    pool_seed = seed * 1000
    pool: list[Story] = []
    exam = {p.text_sha256 for p in exam_problems()}
    while True:
        ids = torch.full((batch, CONTEXT), PAD_ID, dtype=torch.long)
        weights = torch.zeros((batch, CONTEXT))
        for row in range(batch):
            tokens, wts = [BOS_ID], [0.0]
            earlier: list[Story] = []
            while True:
                if not pool:
                    pool_seed += 1
                    pool = training_stories(pool_seed, 512)
                if rng.random() < CODE_SHARE:
                    problem = render(pool.pop())
                    if problem.text_sha256 in exam:
                        continue
                    if not _append(tokenizer, tokens, wts, code_prompt_of(problem.text), problem.program):
                        break
                    continue
                roll = rng.random()
                if earlier and roll < REPEAT_SHARE:
                    story = rng.choice(earlier)
                elif earlier and roll < REPEAT_SHARE + NEAR_MISS_SHARE:
                    story = near_miss(rng.choice(earlier), rng)
                else:
                    story = pool.pop()
                problem = render(story)
                if problem.text_sha256 in exam:  # a near miss may land on an exam problem: never train on it
                    continue
                if not _append(tokenizer, tokens, wts, prompt_of(problem.text), problem.solution):
                    break
                earlier.append(story)
            ids[row, : len(tokens)] = torch.tensor(tokens)
            weights[row, : len(wts)] = torch.tensor(wts)
        yield ids, weights


def _engine(model: torch.nn.Module) -> Engine:
    # Generation never touches the store; a path that does not exist makes sure nothing is written.
    return Engine(model, build_byte_tokenizer(), "demo", store=LocalStore(Path("/nonexistent")))  # type: ignore[arg-type]


def greedy_pass_at_1(model: torch.nn.Module, problems: list[Problem]) -> tuple[float, float]:
    """(accuracy, mean decode tokens) with greedy decoding from `<bos>Q:...\\nA:`, stopping at a newline."""
    engine = _engine(model)
    correct, tokens = 0, 0
    for problem in problems:
        result = engine.generate(prompt_of(problem.text), params=SamplingParams(max_new_tokens=160, stop=("\n",)))
        correct += extract_integer_answer(result.text) == problem.answer
        tokens += len(result.output_tokens)
    return correct / len(problems), tokens / len(problems)


def program_value(program: str) -> int | None:
    """What a one-line program prints, if it is `print(<integer arithmetic>)`.

    The pattern admits only digits, + - * and spaces inside `print(...)`, and `**` is refused (a power can take
    unbounded time), so `eval` of the inner expression runs small arithmetic and nothing else (the real code rung
    runs programs in the sandbox).

    Args:
        program: the model's program line.

    Returns:
        The printed integer; None for anything else (another shape, or operators in a wrong order).
    """
    match = _PROGRAM.match(program)
    if match is None or "**" in match.group(1):
        return None
    try:
        value = eval(match.group(1), {"__builtins__": {}}, {})  # checked above: + - * on integers only
    except SyntaxError:  # e.g. "3+" or "07": digits and operators in a wrong order
        return None
    return value if isinstance(value, int) else None


def program_pass_at_1(model: torch.nn.Module, problems: list[Problem]) -> float:
    """Fraction whose greedy program from `<bos>Q:...\\nCode:` (up to a newline) prints the answer."""
    engine = _engine(model)
    params = SamplingParams(max_new_tokens=PROGRAM_MAX_TOKENS, stop=("\n",))
    correct = 0
    for problem in problems:
        result = engine.generate(code_prompt_of(problem.text), params=params)
        correct += program_value(result.text.split("\n", 1)[0].strip()) == problem.answer
    return correct / len(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--target-accuracy", type=float, default=0.45)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("src/kvgraft/data/demo_model"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(demo_config(), dtype=torch.float32)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def lr_at(step: int) -> float:
        return min(1.0, (step + 1) / args.warmup)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    data = sequences(args.seed, args.batch)
    started = time.perf_counter()
    held_out = training_problems(999_999, 100)
    evals: list[tuple[int, float]] = []
    steps = args.max_steps
    for step in range(args.max_steps):
        ids, weights = next(data)
        logits = model(input_ids=ids).logits[:, :-1].float()
        targets, w = ids[:, 1:], weights[:, 1:]
        loss_per = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        )
        loss = (loss_per * w.reshape(-1)).sum() / w.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if (step + 1) % args.eval_every == 0:
            elapsed = time.perf_counter() - started
            model.eval()
            accuracy, _ = greedy_pass_at_1(model, held_out)
            model.train()
            evals.append((step + 1, accuracy))
            print(
                f"step {step + 1:5d}  loss {loss.item():.4f}  held-out pass@1 {accuracy:.2f}  {elapsed / 60:.1f} min",
                flush=True,
            )
            if accuracy >= args.target_accuracy:
                steps = step + 1
                break
    train_minutes = (time.perf_counter() - started) / 60
    model.eval()
    accuracy, mean_tokens = greedy_pass_at_1(model, held_out)
    exam = exam_problems()
    exam_accuracy, _ = greedy_pass_at_1(model, exam)
    program_accuracy = program_pass_at_1(model, held_out)
    exam_program_accuracy = program_pass_at_1(model, exam)
    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(args.out / WEIGHTS_FILE), metadata={"format": "pt"})
    digest = hashlib.sha256((args.out / WEIGHTS_FILE).read_bytes()).hexdigest()
    (args.out / SHA_FILE).write_text(f"{digest}  {WEIGHTS_FILE}\n")
    facts = {
        "architecture": "Gemma4 (gemma4_text)",
        "parameters": params,
        "weights_bytes": (args.out / WEIGHTS_FILE).stat().st_size,
        "weights_sha256": digest,
        "steps": steps,
        "evaluations": evals,
        "target_accuracy": args.target_accuracy,
        "schedule": f"AdamW lr {args.lr} (betas 0.9/0.95, wd 0.01), linear warmup {args.warmup} steps, then constant",
        "batch": args.batch,
        "context": CONTEXT,
        "tokens_seen": steps * args.batch * CONTEXT,
        "train_minutes": round(train_minutes, 1),
        "threads": torch.get_num_threads(),
        "held_out_greedy_pass_at_1": accuracy,
        "held_out_mean_decode_tokens": mean_tokens,
        "exam_greedy_pass_at_1": exam_accuracy,
        "held_out_program_pass_at_1": program_accuracy,
        "exam_program_pass_at_1": exam_program_accuracy,
        "seed": args.seed,
        "mix": {
            "code_share": CODE_SHARE,
            "repeat": REPEAT_SHARE,
            "near_miss": NEAR_MISS_SHARE,
            "question_loss_weight": QUESTION_WEIGHT,
        },
    }
    (args.out / "training.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
