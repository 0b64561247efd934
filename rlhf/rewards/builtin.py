"""The built-in reward functions, and the number parsing they share.

Built-ins (use these specs in `reward.functions[].path`):

- `rlhf.rewards.arith:exact_match`: the synthetic arithmetic task; the response must be the
  integer answer and nothing else.
- `rlhf.rewards.gsm8k:score`: GSM8K; the answer after "####", else the last number.
- `rlhf.rewards.math:boxed`: MATH-style; the last \\boxed{...}, compared as a number when both
  sides are numbers, else as normalised text.
"""

import re
from fractions import Fraction

BUILTIN_FUNCTIONS = ("rlhf.rewards.arith:exact_match", "rlhf.rewards.gsm8k:score",
                     "rlhf.rewards.math:boxed")

# Only commas between a digit and a group of exactly three digits are thousands separators,
# so "1,234" is 1234 while "1,2" (a pair) stays two numbers.
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")
_SLASH_FRACTION = re.compile(r"([+-]?\d+)/([+-]?\d+)")
_LATEX_FRACTION = re.compile(r"([+-]?)\\[dt]?frac(?:\{([+-]?\d+)\}\{([+-]?\d+)\}|(\d)(\d))")
# Tokenizer end markers a decoded response may still carry: <|eos|>, <|im_end|>, </s>, ...
_END_MARKERS = re.compile(r"(\s*(<\|[^<>|]*\|>|</s>))+\s*$")


def remove_thousands_separators(text: str) -> str:
    """'1,234,567' -> '1234567'; other commas are kept."""
    return _THOUSANDS.sub("", text)


def strip_end_markers(text: str) -> str:
    """text without surrounding whitespace and trailing special tokens such as <|eos|>."""
    return _END_MARKERS.sub("", text).strip()


def parse_number(text: str) -> Fraction | None:
    """The exact value of an integer, decimal or simple fraction ('3/4', '\\frac{3}{4}'), else None.

    Thousands separators are allowed ('1,000'); surrounding whitespace is ignored.
    """
    text = remove_thousands_separators(text.strip())
    if _DECIMAL.fullmatch(text):
        return Fraction(text)
    match = _SLASH_FRACTION.fullmatch(text)
    if match:
        numerator, denominator = int(match[1]), int(match[2])
        return Fraction(numerator, denominator) if denominator else None
    match = _LATEX_FRACTION.fullmatch(text)
    if match:
        numerator = int(match[2] if match[2] is not None else match[4])
        denominator = int(match[3] if match[3] is not None else match[5])
        if denominator == 0:
            return None
        return Fraction(-numerator if match[1] == "-" else numerator, denominator)
    return None
