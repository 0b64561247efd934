"""Multi-digit arithmetic for the calculator tool (rlhf.envs.tools.CalculatorEnv), as JSONL.

A problem is "372*48=": a first operand of digits[0] digits, an operator, a second operand of
digits[1] digits; the ground truth is its exact value ("17856"). With the default 3- and
2-digit operands the tiny model cannot compute the products itself, but it can call the tool:

    <tool_call>{"name": "calculator", "arguments": {"expression": "372*48"}}</tool_call>

SFT rows are whole episodes written as the one `response` text that `rlhf sft` trains on: the
model's call turn, the tool's result as the chat template renders it for that turn
(rlhf.envs.render.TurnRenderer, exactly what the multi-turn rollout appends), then the final
answer, the tool's result copied; or, with `messages`, as a chat transcript, of which
`rlhf sft` trains on the model's turns only. Kinds: "sft" calls with the right expression; "format" calls
with the prompt's operands but an operator drawn at random from `ops`, so a policy warm-started
on it calls and answers well-formed but is right only when the draw matches, and RL must teach
using the prompt's operator; "direct" answers without the tool (the no-tool baseline).
Train and val never share a problem (rlhf.demo.arithmetic_data.problem_split, a hash of the prompt).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from rlhf.demo.arithmetic_data import SPLITS, evaluate, problem_split
from rlhf.envs.render import TurnRenderer
from rlhf.errors import ConfigError, RLHFError
from rlhf.files import atomic_write

CALC_OPS = "+-*"
DATA_SOURCE = "calc"
KINDS = ("rl", "sft", "format", "direct")
TRACE_KINDS = ("sft", "format")


@dataclass(frozen=True, kw_only=True)
class CalcTask:
    """Which problems to draw: operators and the digit count of each operand."""

    ops: str = CALC_OPS
    """Operators to draw from: a non-empty subset of "+-*"."""
    digits: tuple[int, int] = (3, 2)
    """Digits of the first and second operand, e.g. (3, 2): 100..999 and 10..99."""

    def __post_init__(self):
        bad = sorted(set(self.ops) - set(CALC_OPS))
        if not self.ops or bad:
            raise ConfigError(f"ops must be a non-empty subset of {CALC_OPS!r}, got {self.ops!r}; "
                              f"use e.g. ops='+-*'")
        if len(self.digits) != 2 or not all(1 <= d <= 9 for d in self.digits):
            raise ConfigError(f"digits must be two numbers from 1 to 9 (first and second "
                              f"operand), got {self.digits!r}; use e.g. digits=(3, 2)")


def _operand(digits: int, rng: random.Random) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)


def draw_problems(task: CalcTask, *, n: int, seed: int, split: str = "all") -> list[dict]:
    """n problems {"prompt", "ground_truth", "operands", "op"} of `split`; the same seed gives
    the same list."""
    if n < 1:
        raise ConfigError(f"n must be at least 1, got {n}")
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    rng, drawn = random.Random(seed), []
    for _ in range(1000 * n):
        operands = [_operand(d, rng) for d in task.digits]
        op = rng.choice(task.ops)
        prompt = f"{operands[0]}{op}{operands[1]}="
        if split == "all" or problem_split(prompt) == split:
            drawn.append({"prompt": prompt, "ground_truth": str(evaluate(operands, [op])),
                          "operands": operands, "op": op})
            if len(drawn) == n:
                return drawn
    raise ConfigError(f"could not draw {n} {split} problems from ops={task.ops!r}, "
                      f"digits={task.digits}; widen the task")


def tool_call_text(expression: str) -> str:
    """The model's call of the calculator, as rlhf.envs.tools.parse_tool_calls reads it."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def trace_text(expression: str, result: str, *, renderer: TurnRenderer) -> str:
    """One episode as a response text: the call turn and its EOS, the tool's result as the
    chat template renders it after that turn, then the final answer (`rlhf sft` adds its EOS)."""
    eos = renderer.eos_text
    if not eos:
        raise RLHFError("the tokenizer has no eos token; a model turn must end with one")
    observation = renderer.text([{"role": "tool", "content": result}],
                                model_ids=[renderer.eos_id])
    return tool_call_text(expression) + eos + observation + result


def transcript(prompt: str, expression: str, result: str) -> list[dict]:
    """One episode as chat messages: the user's problem, the model's call, the tool's result and
    the model's answer; `rlhf sft` trains on the two assistant turns only."""
    return [{"role": "user", "content": prompt},
            {"role": "assistant", "content": tool_call_text(expression)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result}]


def write_calc_dataset(out: Path, *, task: CalcTask, n: int, seed: int, kind: str = "rl",
                       split: str = "all", tokenizer=None, overwrite: bool = False,
                       messages: bool = False) -> int:
    """Write n JSONL rows to out atomically and return n.

    Every row has prompt, ground_truth, data_source; kind "sft" / "format" add `response`, a
    whole tool-use episode rendered with `tokenizer`'s chat template (required for them), or
    with `messages` the episode as a chat transcript instead; "direct" adds `response` = the
    answer alone.
    """
    if messages and kind not in TRACE_KINDS:
        raise ConfigError(f"messages applies to the episode kinds {', '.join(TRACE_KINDS)}, "
                          f"not {kind!r}")
    if kind not in KINDS:
        raise ConfigError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if kind in TRACE_KINDS and tokenizer is None and not messages:
        raise ConfigError(f"kind {kind!r} writes tool-use traces through a chat template: give "
                          f"the model folder whose tokenizer renders them (--model DIR)")
    out = Path(out)
    if out.exists() and not overwrite:
        raise RLHFError(f"{out} already exists; pass --overwrite (overwrite=True) to replace it")
    if out.is_dir():
        raise RLHFError(f"{out} is a folder; give a file path for the JSONL dataset")
    renderer = TurnRenderer(tokenizer) if kind in TRACE_KINDS and not messages else None
    # Its own stream, so the problems of a format file are those of the rl/sft files.
    pick = random.Random(f"calc-format-{seed}")
    problems = draw_problems(task, n=n, seed=seed, split=split)
    with atomic_write(out, encoding="utf-8") as f:
        for p in problems:
            record = {"prompt": p["prompt"], "ground_truth": p["ground_truth"],
                      "data_source": DATA_SOURCE}
            if kind == "direct":
                record["response"] = p["ground_truth"]
            elif kind in TRACE_KINDS:
                op = p["op"] if kind == "sft" else pick.choice(task.ops)
                a, b = p["operands"]
                result = str(evaluate([a, b], [op]))
                if messages:
                    record["messages"] = transcript(p["prompt"], f"{a}{op}{b}", result)
                else:
                    record["response"] = trace_text(f"{a}{op}{b}", result, renderer=renderer)
            f.write(json.dumps(record) + "\n")
    return len(problems)
