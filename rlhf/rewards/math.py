"""MATH-style reward: the last \\boxed{...} answer against the ground truth."""

import re

from rlhf.rewards.builtin import parse_number

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
# Light normalisation: spacing commands, \left/\right, dollar signs and degree marks go;
# \text{...} and \mathrm{...} keep their content; \dfrac and \tfrac become \frac.
_DROP = re.compile(r"\\left|\\right|\\[,;:! ]|\\quad|\$|\^\{?\\circ\}?|\s+")
_UNWRAP = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]frac")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces, else None."""
    start = max(text.rfind(opener) + len(opener) if opener in text else -1
                for opener in _BOX_OPENERS)
    if start < 0:
        return None
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None  # the box is never closed


def normalize(answer: str) -> str:
    """answer with spacing, \\left/\\right, $ and text wrappers removed, and a final '.' dropped."""
    answer = _UNWRAP.sub(r"\1", answer)
    answer = _FRAC.sub(r"\\frac", _DROP.sub("", answer))
    return answer.removesuffix(".")


def is_equivalent(answer: str, truth: str) -> bool:
    """Numeric equality when both parse as numbers, else equality of the normalised strings."""
    answer, truth = normalize(answer), normalize(truth)
    answer_value, truth_value = parse_number(answer), parse_number(truth)
    if answer_value is not None and truth_value is not None:
        return answer_value == truth_value
    return answer == truth


def boxed(*, prompt: str, response: str, ground_truth, extra: dict) -> dict:
    """1.0 when the response's last boxed answer matches the ground truth, else 0.0.

    A ground truth that itself holds a \\boxed{} is compared by its boxed part; metric no_box
    is 1 when the response has no complete \\boxed{...}.
    """
    truth = str(ground_truth)
    truth = last_boxed(truth) if last_boxed(truth) is not None else truth
    answer = last_boxed(response)
    if answer is None:
        return {"score": 0.0, "no_box": 1.0}
    return {"score": float(is_equivalent(answer, truth)), "no_box": 0.0}
