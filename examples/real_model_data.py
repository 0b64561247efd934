"""Write the real-model example's prompts: "What is 7 + 12? Answer with the number only."

Sums of two numbers from 1 to MAX_VALUE, as plain-language questions that the model's chat
template wraps. One sum in five goes to the validation file, chosen by a hash of its prompt,
so the two files never share a question.

    python examples/real_model_data.py OUT_DIR   # writes OUT_DIR/train.jsonl, OUT_DIR/val.jsonl
"""

import hashlib
import json
import sys
from pathlib import Path

MAX_VALUE = 30
QUESTION = "What is {a} + {b}? Answer with the number only."


def rows() -> list[dict]:
    return [{"prompt": QUESTION.format(a=a, b=b), "ground_truth": str(a + b)}
            for a in range(1, MAX_VALUE + 1) for b in range(1, MAX_VALUE + 1)]


def is_val(prompt: str) -> bool:
    return hashlib.sha256(prompt.encode()).digest()[0] % 5 == 0


def main(out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, keep in (("train", False), ("val", True)):
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows():
                if is_val(row["prompt"]) == keep:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
