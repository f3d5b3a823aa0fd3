"""A judge's supervised data from a policy's scored samples: each (problem, sampled answer) pair becomes the judge
prompt of a run's config (`reward.judge.template`) and, as its target, the verdict the rule gave it: the
top-scoring word of `reward.judge.choices` for an answer the rule scored 1, the lowest-scoring one otherwise.

    python examples/judge/make_data.py --config configs/judge_quickstart.yaml \
        --samples outputs/judge_quickstart/data/candidates_train.jsonl \
        --out outputs/judge_quickstart/data/judge_train.parquet

`--samples` is a file of `launchers/generate.py` (sampled at temperature 1, so that the wrong answers are the
policy's own near misses, not made-up ones). Prompts are taken as the policy's text: the chat messages' contents
joined by newlines (the quick start's data have one message and no chat template).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.config import load_config
from megarl.data.dataset import write_rows
from megarl.rewards.judge import render_judge_prompt


def judge_rows(samples: list[dict], template: str, choices: dict[str, float]) -> list[dict]:
    """One SFT row per sample: the judge's prompt, and the verdict for its rule score as the ground truth."""
    right, wrong = max(choices, key=choices.get), min(choices, key=choices.get)
    rows = []
    for sample in samples:
        prompt = sample["prompt"]
        text = prompt if isinstance(prompt, str) else "\n".join(message["content"] for message in prompt)
        judge_prompt = render_judge_prompt(template, text, sample["response"], sample["ground_truth"])
        rows.append({"prompt": [{"role": "user", "content": judge_prompt}], "data_source": "judge",
                     "ability": "judge", "reward_model": {"style": "rule", "ground_truth": right if sample["score"] >= 1
                                                          else wrong},
                     "extra_info": {"index": len(rows)}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the judge-rewarded run's config (reward.judge)")
    parser.add_argument("--samples", required=True, help="a launchers/generate.py .jsonl of scored samples")
    parser.add_argument("--out", required=True, help="the judge's SFT data (.parquet)")
    args = parser.parse_args()
    judge = load_config(args.config).reward.judge
    if len(judge.choices) < 2:
        raise SystemExit("reward.judge.choices needs a verdict for right and one for wrong answers")
    samples = [json.loads(line) for line in Path(args.samples).read_text().splitlines()]
    rows = judge_rows(samples, judge.template, dict(judge.choices))
    write_rows(rows, args.out)
    right = sum(sample["score"] >= 1 for sample in samples)
    print(f"wrote {len(rows)} judge examples to {args.out}: {right} right answers, {len(rows) - right} wrong")


if __name__ == "__main__":
    main()
