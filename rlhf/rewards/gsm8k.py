"""GSM8K reward: the response's final number against the answer after '####'."""

import re

from rlhf.rewards.builtin import parse_number

# "#### 1,234.5" (strict) and any number (flexible); commas are resolved by parse_number.
_STRICT = re.compile(r"####\s*\$?\s*([+-]?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?|[+-]?\.\d+")


def extract_answer(response: str) -> tuple[str | None, str]:
    """(answer text, extraction used): 'strict' for the last '#### N', else 'flexible' for the
    last number in the response, else (None, 'none')."""
    strict = _STRICT.findall(response)
    if strict:
        return strict[-1], "strict"
    numbers = [n.rstrip(",") for n in _NUMBER.findall(response)]
    if numbers:
        return numbers[-1], "flexible"
    return None, "none"


def score(*, prompt: str, response: str, ground_truth, extra: dict) -> dict:
    """1.0 when the extracted answer equals the ground truth's number (after '####' if present).

    Metrics strict / flexible / no_answer say how the answer was found.
    """
    truth_text = str(ground_truth).rpartition("####")[2]
    truth = parse_number(truth_text)
    if truth is None:
        raise ValueError(f"ground truth {ground_truth!r} has no number after '####'")
    answer, mode = extract_answer(response)
    value = parse_number(answer) if answer is not None else None
    return {"score": float(value is not None and value == truth),
            "strict": float(mode == "strict"), "flexible": float(mode == "flexible"),
            "no_answer": float(mode == "none")}
