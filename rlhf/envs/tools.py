"""Tool calling: the `<tool_call>{json}</tool_call>` format, its parser, and `ToolEnv`.

A model calls a tool by writing, anywhere in its turn,

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>

(the JSON-in-tags convention of Qwen/Hermes chat templates). Each call's result comes back as
a message with role "tool"; the tiny tokenizer's chat template renders it as a user turn
holding `<tool_response>RESULT</tool_response>`, as real models' templates do. A turn without
a call is the final answer and ends the episode. A malformed call is not a crash: its
observation is "error: ..." and it counts in env/tool_errors.
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf.envs.base import Env, StepResult

_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and arguments, or why it could not be parsed."""

    name: str | None
    arguments: dict
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` in text, in order; malformed ones carry `error`."""
    calls = []
    for match in _CALL_RE.finditer(text):
        body, closed = match.group(1).strip(), match.group(2)
        if not closed:
            calls.append(ToolCall(None, {}, "unterminated <tool_call>: close it with </tool_call>"))
            continue
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, {}, f"the call is not valid JSON ({e.msg})"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(ToolCall(None, {}, 'a call is {"name": ..., "arguments": {...}}'))
            continue
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            calls.append(ToolCall(payload["name"], {}, "arguments must be a JSON object"))
            continue
        calls.append(ToolCall(payload["name"], arguments))
    return calls


def describe_tool(fn: Callable) -> str:
    """One line per tool for a system prompt: name(signature): first docstring line."""
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    return f"{fn.__name__}{inspect.signature(fn, eval_str=True)}: {doc}"


class ToolEnv(Env):
    """An environment whose actions are tool calls; a tool is a plain Python function with a
    docstring (`tools`). Override `final_reward` to score the answer (a turn without calls)."""

    tools: tuple[Callable, ...] = ()

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.by_name = {fn.__name__: fn for fn in self.tools}
        self.ground_truth: Any = None

    def reset(self, *, prompt: Any, ground_truth: Any, extra: dict) -> None:
        self.ground_truth = ground_truth

    def final_reward(self, text: str) -> float:
        """Score of the final answer; 0 unless a subclass says otherwise."""
        return 0.0

    def step(self, *, text: str, token_ids: list[int]) -> StepResult:
        calls = parse_tool_calls(text)
        if not calls:
            return StepResult(reward=self.final_reward(text), done=True,
                              metrics={"tool_calls": 0.0, "tool_errors": 0.0})
        results = [self.run_call(call) for call in calls]
        errors = sum(r.startswith("error: ") for r in results)
        return StepResult(observation=[{"role": "tool", "content": r} for r in results],
                          metrics={"tool_calls": float(len(calls)), "tool_errors": float(errors)})

    def run_call(self, call: ToolCall) -> str:
        """The tool's result as text, or "error: ..." (unknown tool, bad arguments, it raised)."""
        if call.error is not None:
            return f"error: {call.error}"
        fn = self.by_name.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.by_name))}"
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return f"error: bad arguments for {call.name}: {e}"
        try:
            return str(fn(**call.arguments))
        except Exception as e:  # a tool's failure is the model's observation, not a crash
            return f"error: {call.name} raised {type(e).__name__}: {e}"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculator(expression: str) -> str:
    """Evaluate integer arithmetic with + - * // % and parentheses, e.g. "12*(3+4)"."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**30:
                raise ValueError("result too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression {ast.unparse(node)!r}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    with warnings.catch_warnings():  # "3or 4" warns (invalid decimal literal) before it fails
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(expression.strip(), mode="eval")
    return str(ev(tree.body))


_LAST_INT = re.compile(r"-?\d+")


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool: reward 1 when the final answer's last integer equals
    the ground truth."""

    tools = (calculator,)

    def final_reward(self, text: str) -> float:
        numbers = _LAST_INT.findall(text)
        return float(bool(numbers) and numbers[-1] == str(self.ground_truth).strip())
