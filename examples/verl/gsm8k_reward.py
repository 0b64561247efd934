"""A reward file in verl's convention (verl's custom_reward_function), used here unchanged:
the loader sees the solution_str parameter and calls it with verl's arguments."""

import re

_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 for the right number after '####', 0.1 for a wrong one in the right format."""
    found = _ANSWER.findall(solution_str)
    if not found:
        return 0.0
    answer = found[-1].replace(",", "").rstrip(".")
    return 1.0 if answer == str(ground_truth) else 0.1
