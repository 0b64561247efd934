"""Exact-match reward of the synthetic arithmetic task (rlhf.demo.arithmetic_data)."""

import re

from rlhf.rewards.builtin import strip_end_markers

_INTEGER = re.compile(r"[+-]?\d+")


def exact_match(*, prompt: str, response: str, ground_truth, extra: dict) -> dict:
    """1.0 when the response is exactly the integer answer, else 0.0.

    Whitespace, trailing special tokens and one trailing period are ignored; a response that
    is not an integer scores 0 and reports format_error = 1.
    """
    answer = strip_end_markers(response).removesuffix(".").strip()
    expected = int(str(ground_truth).strip())  # a non-integer ground truth is a data error
    if not _INTEGER.fullmatch(answer):
        return {"score": 0.0, "format_error": 1.0}
    return {"score": float(int(answer) == expected), "format_error": 0.0}
