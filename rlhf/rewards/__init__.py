"""Reward functions: plain Python callables named 'module:function' or 'file.py:function'.

The calling convention is in rlhf.rewards.protocol, the built-ins in rlhf.rewards.builtin,
and the parallel runner in rlhf.rewards.runner.
"""

from rlhf.rewards.loader import check_reward_functions, check_signature, load_reward_function
from rlhf.rewards.protocol import EXPECTED_SIGNATURE, parse_reward_output

# The runner pulls in torch; reward worker processes import this package and must not, so
# its names load on first use.
_LAZY = {"RewardRunner", "RewardResult", "combine_scores"}

__all__ = ["EXPECTED_SIGNATURE", "check_reward_functions", "check_signature",
           "load_reward_function",
           "parse_reward_output", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        from rlhf.rewards import runner  # noqa: PLC0415 - deferred on purpose, see above

        return getattr(runner, name)
    raise AttributeError(f"module 'rlhf.rewards' has no attribute {name!r}")
