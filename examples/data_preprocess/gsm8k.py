"""Turn a local GSM8K file into a parquet file in megarl's prompt layout. Nothing is downloaded.

    python examples/data_preprocess/gsm8k.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet --split train

The input (.jsonl, .json or .parquet) has `question` and `answer`, the answer ending in `#### N`.
The prompt is the question plus an instruction to end with "#### N" (what the strict gsm8k scorer
expects); the ground truth is N without thousands separators; data_source is "openai/gsm8k".
"""

from __future__ import annotations

import argparse
import re

from megarl.data.dataset import read_records, write_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def extract_final_answer(answer: str) -> str | None:
    """N of the last `#### N`, commas removed (as verl does), or None."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", answer)
    return found[-1].replace(",", "") if found else None


def convert(records: list[dict], split: str, source: str) -> list[dict]:
    rows = []
    for index, record in enumerate(records):
        for key in ("question", "answer"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{source}: row {index}, key {key!r}: expected a str, got {record.get(key)!r:.60}")
        ground_truth = extract_final_answer(record["answer"])
        if ground_truth is None:
            raise ValueError(f"{source}: row {index}, key 'answer': expected it to end with '#### <number>'")
        rows.append({
            "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
            "data_source": DATA_SOURCE,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": split, "index": index, "question": record["question"], "answer": record["answer"]},
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a local GSM8K file to megarl's parquet layout.")
    parser.add_argument("--input", required=True, help="local .jsonl, .json or .parquet with question/answer")
    parser.add_argument("--output", required=True, help="parquet file to write")
    parser.add_argument("--split", required=True, help="split name stored in extra_info (train, test, ...)")
    args = parser.parse_args(argv)
    rows = convert(read_records(args.input), args.split, args.input)
    print(f"wrote {len(rows)} rows to {write_rows(rows, args.output)}")


if __name__ == "__main__":
    main()
