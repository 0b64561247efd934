"""Synthetic integer tasks with exact answers, written as JSONL datasets.

Two forms. "expr": the expression with no spaces followed by "=", e.g. "12+7-3="; "*" binds
tighter than "+" and "-", as in Python. "max": the largest of the operands, e.g.
"max(12,7)=". The answer (ground truth and SFT response) is just the integer in decimal, e.g.
"16" or "-4", so an exact-match reward can check it. Operands are drawn from 0..max_value.
With the byte-level tokenizer every digit is its own token, so a default prompt ("12+7=") is
about 6 tokens.

SFT rows come in two kinds: "sft" teaches the answer; "format" teaches only its shape (a
number, then EOS) with one of the prompt's operands picked at random as the target, so a
policy warm-started on it answers well-formed but at about chance, and RL must teach the skill.
"""

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from rlhf.errors import ConfigError, RLHFError
from rlhf.files import atomic_write

ARITH_OPS = "+-*"
MAX_TERMS = 6
DATA_SOURCE = "arith"
SPLITS = ("all", "train", "val")
FORMS = ("expr", "max")
KINDS = ("rl", "sft", "format")
# One problem in VAL_SHARE goes to the held-out split, chosen by a hash of its prompt, so a
# train file and a val file never share a problem whatever seeds they were drawn with.
VAL_SHARE = 5


@dataclass(frozen=True, kw_only=True)
class ArithTask:
    """Which problems to draw: form, operators, operand range and operands per problem."""

    form: str = "expr"
    """expr: an expression such as "12+7-3="; max: the largest operand, "max(12,7)="."""
    ops: str = "+-"
    """Operators to draw from: a non-empty subset of "+-*" (form expr only)."""
    max_value: int = 20
    """Largest operand; operands are drawn uniformly from 0..max_value."""
    terms: int = 2
    """Operands per problem (2 to 6)."""

    def __post_init__(self):
        if self.form not in FORMS:
            raise ConfigError(f"form must be one of {', '.join(FORMS)}; got {self.form!r}")
        bad = sorted(set(self.ops) - set(ARITH_OPS))
        if not self.ops or bad:
            raise ConfigError(f"ops must be a non-empty subset of {ARITH_OPS!r}, got {self.ops!r}; "
                              f"use e.g. ops='+-'")
        if self.max_value < 1:
            raise ConfigError(f"max_value must be at least 1, got {self.max_value}")
        if not 2 <= self.terms <= MAX_TERMS:
            raise ConfigError(f"terms must be between 2 and {MAX_TERMS}, got {self.terms}")


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Exact value of operands[0] ops[0] operands[1] ..., with "*" before "+" and "-"."""
    # Fold each run of products into one term, then add the signed terms left to right.
    terms, signs = [operands[0]], [1]
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms))


def _draw_problem(task: ArithTask, rng: random.Random) -> tuple[dict, list[int]]:
    """One problem {"prompt", "ground_truth"} and its operands."""
    operands = [rng.randint(0, task.max_value) for _ in range(task.terms)]
    if task.form == "max":
        problem = {"prompt": f"max({','.join(map(str, operands))})=",
                   "ground_truth": str(max(operands))}
        return problem, operands
    ops = [rng.choice(task.ops) for _ in range(task.terms - 1)]
    expr = str(operands[0]) + "".join(op + str(value) for op, value in zip(ops, operands[1:]))
    return {"prompt": f"{expr}=", "ground_truth": str(evaluate(operands, ops))}, operands


def problem_split(prompt: str) -> str:
    """'val' or 'train': a fixed function of the prompt text."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return "val" if int.from_bytes(digest[:4], "little") % VAL_SHARE == 0 else "train"


def generate_problems(task: ArithTask, *, n: int, seed: int, split: str = "all") -> list[dict]:
    """n problems {"prompt": "12+7-3=", "ground_truth": "16"}; the same seed gives the same list.

    split "train" or "val" keeps only problems of that split (see problem_split).
    """
    return [problem for problem, _ in _draw_split(task, n=n, seed=seed, split=split)]


def _draw_split(task: ArithTask, *, n: int, seed: int, split: str) -> list[tuple[dict, list]]:
    if n < 1:
        raise ConfigError(f"n must be at least 1, got {n}")
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    rng = random.Random(seed)
    drawn = []
    for _ in range(1000 * n):
        problem, operands = _draw_problem(task, rng)
        if split == "all" or problem_split(problem["prompt"]) == split:
            drawn.append((problem, operands))
            if len(drawn) == n:
                return drawn
    raise ConfigError(f"could not draw {n} {split} problems from form={task.form!r}, "
                      f"ops={task.ops!r}, max_value={task.max_value}, terms={task.terms}; "
                      f"widen the task")


def sample_text(task: ArithTask, *, n: int, seed: int) -> list[str]:
    """Plain arithmetic text for tokenizer training: prompts and answers as separate strings."""
    # Kept apart so BPE never learns merges across the prompt/response boundary (e.g. "=-").
    texts = []
    for problem in generate_problems(task, n=n, seed=seed):
        texts += [problem["prompt"], problem["ground_truth"]]
    return texts


def write_arith_dataset(out: Path, *, task: ArithTask, n: int, seed: int, kind: str = "rl",
                        split: str = "all", overwrite: bool = False) -> int:
    """Write n JSONL rows to out atomically and return n.

    kind "rl": prompt, ground_truth, data_source; kind "sft" adds response (the answer text);
    kind "format" adds response = one of the prompt's operands at random (right or not).
    split "train" / "val" draws only problems of that split, so the two never overlap.
    """
    if kind not in KINDS:
        raise ConfigError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    out = Path(out)
    if out.exists() and not overwrite:
        raise RLHFError(f"{out} already exists; pass --overwrite (overwrite=True) to replace it")
    if out.is_dir():
        raise RLHFError(f"{out} is a folder; give a file path for the JSONL dataset")
    drawn = _draw_split(task, n=n, seed=seed, split=split)
    # Its own stream, so the problems of a format file are those of the rl/sft files.
    pick = random.Random(f"format-{seed}")
    with atomic_write(out, encoding="utf-8") as f:
        for row, operands in drawn:
            record = {"prompt": row["prompt"], "ground_truth": row["ground_truth"],
                      "data_source": DATA_SOURCE}
            if kind == "sft":
                record["response"] = row["ground_truth"]
            elif kind == "format":
                record["response"] = str(pick.choice(operands))
            f.write(json.dumps(record) + "\n")
    return len(drawn)
