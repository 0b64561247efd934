"""Write the real-model example's prompts: "Which number is larger, 37 or 85?" -> 85.

Pairs of different two-digit numbers, in both orders, as plain-language questions that the
model's chat template wraps. One question in five goes to the validation side, chosen by a hash
of its prompt, so the two files never share a question; the validation file keeps VAL_ROWS of
them so that an evaluation stays short.

    python examples/real_model_data.py OUT_DIR   # writes OUT_DIR/train.jsonl, OUT_DIR/val.jsonl
"""

import hashlib
import json
import sys
from pathlib import Path

QUESTION = "Which number is larger, {a} or {b}?"
VAL_ROWS = 128


def rows() -> list[dict]:
    return [{"prompt": QUESTION.format(a=a, b=b), "ground_truth": str(max(a, b))}
            for a in range(10, 100) for b in range(10, 100) if a != b]


def _hash(prompt: str) -> bytes:
    return hashlib.sha256(prompt.encode()).digest()


def main(out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    train = [r for r in rows() if _hash(r["prompt"])[0] % 5]
    val = sorted((r for r in rows() if not _hash(r["prompt"])[0] % 5),
                 key=lambda r: _hash(r["prompt"]))[:VAL_ROWS]
    for name, part in (("train", train), ("val", val)):
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in part)


if __name__ == "__main__":
    main(sys.argv[1])
