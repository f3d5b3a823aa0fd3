"""How often a run's judge (`reward.judge`) agrees with the rule on scored samples it was not trained on.

    python examples/judge/agreement.py --config configs/judge_quickstart.yaml \
        --samples outputs/judge_quickstart/data/candidates_test.jsonl

`--samples` is a file of `launchers/generate.py` (the rule's score of each sample in it). The judge runs as the
trainer runs it (`megarl.generation.judge`: its engine, rubric and parser, one batch), alone (no rule mixed in).
Printed: the share of samples whose judge reward equals the rule's, the same among the answers the rule found
right and among those it found wrong, and the unparsable verdicts and timeouts (each scored 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.config import load_config
from megarl.distributed.launch import init_process_group
from megarl.generation.judge import JudgeEngine
from megarl.rewards import ScoringItem
from megarl.rewards.judge import JudgeRewards, JudgeRubric


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the judge-rewarded run's config (reward.judge)")
    parser.add_argument("--samples", required=True, help="a launchers/generate.py .jsonl of rule-scored samples")
    args = parser.parse_args()
    config = load_config(args.config)
    samples = [json.loads(line) for line in Path(args.samples).read_text().splitlines()]
    items = [ScoringItem(s["data_source"], s["response"], s["ground_truth"], s["extra_info"],
                         prompt="\n".join(m["content"] for m in s["prompt"])) for s in samples]
    init_process_group()  # the engine joins a world, of one process here
    judge = config.reward.judge
    rubric = JudgeRubric(judge.template, dict(judge.choices), judge.max_score)
    result = JudgeRewards(JudgeEngine.of_run(config), rubric).score(items)
    rule = [s["score"] for s in samples]
    agree = [j == r for j, r in zip(result.scores, rule)]
    right = [a for a, r in zip(agree, rule) if r >= 1]
    wrong = [a for a, r in zip(agree, rule) if r < 1]
    unparsable, timeouts = (int(sum(result.extra[key])) for key in ("judge_unparsable", "judge_timeouts"))
    print(f"{len(samples)} samples ({len(right)} right by the rule, {len(wrong)} wrong): the judge agrees on "
          f"{sum(agree)} ({sum(agree) / len(agree):.2%}); on right answers {sum(right) / max(len(right), 1):.2%}, "
          f"on wrong ones {sum(wrong) / max(len(wrong), 1):.2%}; unparsable {unparsable}, timeouts {timeouts}, "
          f"errors {result.num_errors}")


if __name__ == "__main__":
    main()
