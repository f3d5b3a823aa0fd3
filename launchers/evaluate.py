"""Score a generations file with a run's reward function; print mean@k and pass@k per data source.

    python launchers/evaluate.py generations.jsonl [--config configs/X.yaml] [--json out.json] \
        [reward.function=my_reward.py:compute_score reward.timeout_seconds=10]

Reads the rows `launchers/generate.py` writes (.jsonl or .parquet: data_source, response,
ground_truth, index, extra_info) and scores every response again with the run config's `reward.function`
(default: the rule scorers by data_source), so a file can be re-scored with another function (the
config's reward model, if any, is not applied: it scores tokens, the file holds text). k is the number
of responses per prompt. The metrics are the trainer's
validation metrics (`validation_metrics`), per data source and over all rows:
mean@k = mean score over all k responses of all prompts; pass@k = fraction of prompts with at
least one response scoring >= 1. Pure Python: no torchrun, no model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from megarl.tracking.console import quiet_third_party_logs

quiet_third_party_logs()  # before the libraries are imported: some warn or log while importing
from megarl.config import load_config  # noqa: E402
from megarl.data.dataset import Prompt, read_records  # noqa: E402
from megarl.generation import Rollouts, pass_at_k, reward_manager, validation_metrics  # noqa: E402
from megarl.messages import exit_on_user_error  # noqa: E402
from megarl.rewards import RewardManager, ScoringItem  # noqa: E402

REQUIRED = ("data_source", "response", "ground_truth", "index")


def load_rollouts(path: str, rewards: RewardManager) -> tuple[Rollouts, int]:
    """The file's responses re-scored, grouped by prompt index; and k, the responses per prompt."""
    rows = read_records(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    for number, row in enumerate(rows):
        missing = [column for column in REQUIRED if column not in row]
        if missing:
            raise ValueError(f"{path}: row {number} lacks {', '.join(missing)} (write it with launchers/generate.py)")
    rows.sort(key=lambda row: (row["index"], row.get("sample", 0)))
    prompts = [Prompt([], row["data_source"], row["ground_truth"], row.get("extra_info") or {}, row["index"])
               for row in rows]
    counts = Counter(p.index for p in prompts)
    if len(set(counts.values())) != 1:
        raise ValueError(f"{path}: prompts have different numbers of responses ({sorted(set(counts.values()))})")
    # A scorer that raises or times out gives 0; RewardManager counts it and logs a warning.
    result = rewards.score([ScoringItem(p.data_source, row["response"], p.ground_truth, p.extra_info)
                            for p, row in zip(prompts, rows)])
    rollouts = Rollouts(prompts=prompts, group_ids=[p.index for p in prompts], scores=result.scores)
    return rollouts, next(iter(counts.values()))


def evaluate(rollouts: Rollouts, k: int) -> dict[str, dict[str, float]]:
    """{data source or "all": {"prompts", "mean@k", "pass@k"}}."""
    sources = sorted({p.data_source for p in rollouts.prompts})
    subsets = {s: [i for i, p in enumerate(rollouts.prompts) if p.data_source == s] for s in sources}
    subsets["all"] = list(range(len(rollouts.prompts)))
    table = {}
    for name, indices in subsets.items():
        subset = Rollouts(prompts=[rollouts.prompts[i] for i in indices],
                          group_ids=[rollouts.group_ids[i] for i in indices],
                          scores=[rollouts.scores[i] for i in indices])
        table[name] = {"prompts": len(set(subset.group_ids)),
                       f"mean@{k}": validation_metrics(subset, k)["val/score/mean"],
                       f"pass@{k}": pass_at_k(subset.group_ids, subset.scores)}  # also for k = 1
    return table


def main(argv: list[str]) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("generations", help="a .jsonl or .parquet file written by launchers/generate.py")
    parser.add_argument("--config", help="a run's YAML file (its reward section is read)")
    parser.add_argument("--json", help="also write the table to this JSON file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.function=my_reward.py:score")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides, model_required=False)
    rollouts, k = load_rollouts(args.generations, reward_manager(config))
    table = evaluate(rollouts, k)
    print(f"{'data_source':<32}{'prompts':>8}{f'mean@{k}':>10}{f'pass@{k}':>10}")
    for name, row in table.items():
        print(f"{name:<32}{row['prompts']:>8}{row[f'mean@{k}']:>10.4f}{row[f'pass@{k}']:>10.4f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(table, file, indent=1)
    return table


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ValueError as error:  # config, file and reward-function errors: one line naming the key or path
        exit_on_user_error(error)
