"""Turn GSM8K and MATH files, as they are downloaded, into prompt rows for `rlhf train`.

    python examples/data/prepare_math_data.py gsm8k train.jsonl data/gsm8k/train.parquet
    python examples/data/prepare_math_data.py math MATH/train data/math/train.jsonl --format verl

Inputs: GSM8K's JSON Lines (or Parquet) rows of `question` and `answer` (worked solution ending
in "#### 72"); MATH's rows of `problem` and `solution` (the answer in the last \\boxed{...}), as
JSON Lines, Parquet, one JSON file per problem, or a folder of those (the original archive's
train/<subject>/<n>.json). The output's suffix picks JSON Lines (.jsonl) or Parquet (.parquet).

--format ours (the default) writes {"prompt": [chat], "ground_truth": "72", "data_source"};
--format verl writes verl's layout ({"prompt", "data_source", "ability", "reward_model":
{"style", "ground_truth"}, "extra_info"}), which `rlhf train` reads with
data.ground_truth_key: reward_model.ground_truth (docs/guides/data.md).
"""

import argparse
import json
import re
import sys
from pathlib import Path

# The instruction asks for the answer where the built-in scorer looks for it
# (rlhf.rewards.gsm8k:score reads the last "#### N"; rlhf.rewards.math:boxed the last \boxed{}).
INSTRUCTIONS = {
    "gsm8k": 'Solve the problem step by step, then give the final number after "####".',
    "math": "Solve the problem step by step, then put the final answer in \\boxed{}.",
}
DATA_SOURCES = {"gsm8k": "openai/gsm8k", "math": "hendrycks/competition_math"}
_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$")


def gsm8k_answer(answer: str) -> str:
    """The final number of a GSM8K solution ("... #### 1,234" -> "1234")."""
    match = _GSM8K_ANSWER.search(answer.strip())
    if match is None:
        raise ValueError(f"no '#### N' final answer in {answer[-80:]!r}")
    return match[1].replace(",", "")


def last_boxed(solution: str) -> str:
    """The content of the last \\boxed{...} of a MATH solution, braces balanced."""
    start = solution.rfind("\\boxed{")
    if start < 0:
        raise ValueError(f"no \\boxed{{...}} answer in {solution[-80:]!r}")
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[i], 0)
        if depth < 0:
            return solution[begin:i]
    raise ValueError(f"an unclosed \\boxed{{ in {solution[-80:]!r}")


def read_records(path: Path) -> list[tuple[str, dict]]:
    """(location, record) of every row of a .jsonl, .parquet or .json file, or of a folder's."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl", ".parquet"))
        if not files:
            raise ValueError(f"{path}: the folder holds no .json, .jsonl or .parquet files")
        return [found for file in files for found in read_records(file)]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415 - only Parquet inputs need it

        return [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist(), 1)]
    if path.suffix == ".json":
        return [(str(path), json.loads(path.read_text(encoding="utf-8")))]
    if path.suffix == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        return [(f"{path}:{i}", json.loads(line)) for i, line in enumerate(lines, 1)
                if line.strip()]
    raise ValueError(f"{path}: expected a .jsonl, .parquet or .json file, or a folder of them")


def to_row(dataset: str, record: dict, *, index: int, split: str, layout: str) -> dict:
    """One output row of a GSM8K or MATH record, in our layout or verl's."""
    question_key, solution_key = (("question", "answer") if dataset == "gsm8k"
                                  else ("problem", "solution"))
    missing = [k for k in (question_key, solution_key) if k not in record]
    if missing:
        raise ValueError(f"no {missing} field (fields: {sorted(record)}); a {dataset} row has "
                         f"{question_key!r} and {solution_key!r}")
    question, solution = record[question_key], record[solution_key]
    answer = gsm8k_answer(solution) if dataset == "gsm8k" else last_boxed(solution)
    prompt = [{"role": "user", "content": f"{question}\n\n{INSTRUCTIONS[dataset]}"}]
    if layout == "ours":
        return {"prompt": prompt, "ground_truth": answer, "data_source": DATA_SOURCES[dataset]}
    return {"prompt": prompt, "data_source": DATA_SOURCES[dataset], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "question": question,
                           "answer": solution}}


def write_rows(rows: list[dict], path: Path) -> None:
    """rows as JSON Lines or Parquet, by the path's suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa  # noqa: PLC0415
        import pyarrow.parquet as pq  # noqa: PLC0415

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    else:
        raise ValueError(f"{path}: the output must end in .jsonl or .parquet")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=sorted(INSTRUCTIONS))
    parser.add_argument("input", type=Path, help="downloaded file, or folder of MATH .json files")
    parser.add_argument("output", type=Path, help="OUT.jsonl or OUT.parquet")
    parser.add_argument("--format", choices=("ours", "verl"), default="ours", dest="layout")
    parser.add_argument("--split", default=None, help="extra_info.split (default: input's stem)")
    args = parser.parse_args(argv)
    split = args.split or args.input.stem
    rows = []
    try:
        for index, (where, record) in enumerate(read_records(args.input)):
            try:
                rows.append(to_row(args.dataset, record, index=index, split=split,
                                   layout=args.layout))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        write_rows(rows, args.output)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(rows)} {args.dataset} rows ({args.layout} layout) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
