"""A user-written reward function for the arithmetic quickstart: correct and short answers win.

Any Python file works; the config points at it as 'examples/custom_reward/reward.py:concise_answer'
(paths are relative to the directory you run `rlhf` from). See README.md in this folder.
"""

import re

# The longest answer that costs nothing; every character beyond it costs LENGTH_PENALTY.
FREE_CHARS = 4
LENGTH_PENALTY = 0.05


def concise_answer(*, prompt: str, response: str, ground_truth, extra: dict) -> dict:
    """1 for the right integer, minus a small penalty per character past FREE_CHARS."""
    text = response.strip()
    match = re.match(r"[+-]?\d+", text)
    correct = match is not None and int(match.group()) == int(ground_truth)
    overlong = max(0, len(text) - FREE_CHARS)
    return {
        "score": float(correct) - LENGTH_PENALTY * overlong,
        "correct": float(correct),  # logged as reward/concise_answer/correct (batch mean)
        "response_chars": float(len(text)),
    }
