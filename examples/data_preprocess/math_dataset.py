"""Turn a local MATH file into a parquet file in megarl's prompt layout. Nothing is downloaded.

    python examples/data_preprocess/math_dataset.py --input math/test.jsonl --output data/math/test.parquet --split test

The input (.jsonl, .json: a list of problems or one problem, or .parquet) has `problem` and
`solution`; the ground truth is the content of the solution's last `\\boxed{...}` (or `\\fbox{...}`,
or `\\boxed 5`). The prompt is the problem plus an instruction to answer within \\boxed{}; the
data_source selects the math-verify scorer.
"""

from __future__ import annotations

import argparse

from megarl.data.dataset import read_records, write_rows

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def last_boxed_content(solution: str) -> str | None:
    """The content of the last \\boxed{...} (braces matched), of a trailing `\\boxed x`, or None."""
    start = max(solution.rfind("\\boxed"), solution.rfind("\\fbox"))
    if start < 0:
        return None
    rest = solution[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):  # "\boxed 5$": the answer runs to the end of the math
        return rest.strip().split("$")[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, character in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(character, 0)
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced braces


def convert(records: list[dict], split: str, source: str, data_source: str = DATA_SOURCE) -> list[dict]:
    rows = []
    for index, record in enumerate(records):
        for key in ("problem", "solution"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{source}: row {index}, key {key!r}: expected a str, got {record.get(key)!r:.60}")
        ground_truth = last_boxed_content(record["solution"])
        if ground_truth is None:
            raise ValueError(f"{source}: row {index}, key 'solution': expected a \\boxed{{...}} answer")
        rows.append({
            "prompt": [{"role": "user", "content": f"{record['problem']} {INSTRUCTION}"}],
            "data_source": data_source,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index},
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a local MATH file to megarl's parquet layout.")
    parser.add_argument("--input", required=True, help="local .jsonl, .json or .parquet with problem/solution")
    parser.add_argument("--output", required=True, help="parquet file to write")
    parser.add_argument("--split", required=True, help="split name stored in extra_info (train, test, ...)")
    parser.add_argument("--data-source", default=DATA_SOURCE, help="data_source of the rows (a math scorer)")
    args = parser.parse_args(argv)
    rows = convert(read_records(args.input), args.split, args.input, args.data_source)
    print(f"wrote {len(rows)} rows to {write_rows(rows, args.output)}")


if __name__ == "__main__":
    main()
