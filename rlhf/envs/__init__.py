"""Environments for multi-turn rollouts: the `Env` interface, tool calling, and the runner
that hosts episodes in worker processes with a time limit per call."""

from rlhf.envs.base import Env, StepResult
from rlhf.envs.tools import ToolCall, ToolEnv, parse_tool_calls

__all__ = ["Env", "StepResult", "ToolCall", "ToolEnv", "parse_tool_calls"]
