"""Generate responses to held-out prompts with a run's rollout engine and score them, as the run's validation does.

    torchrun --nproc_per_node=N launchers/generate.py --config configs/X.yaml --output generations.jsonl \
        [model.path=HF_DIR|CHECKPOINT data.val_files=[test.parquet] rollout.val_n=4 rollout.val_temperature=1.0 ...]

The run's config, read as the trainer reads it: the prompts are `data.val_files` (rendered and filtered as in
training: `data.max_prompt_length`, `data.apply_chat_template`, the multi-turn tools' preamble), at most
`data.max_val_samples` of them, sampled with the validation's settings (`rollout.val_n`, `rollout.val_temperature`,
`rollout.top_p`, `rollout.top_k`, seeded by `trainer.seed`) on engines of `rollout.tp` ranks (`rollout.backend`),
scored by `reward.function`; with `rollout.multi_turn.enable` each sample is a trajectory. Given a run's own
config, the written scores' mean is the run's `val/score/mean` for the same weights.

`model.path` is a HuggingFace directory, or a megarl checkpoint (`global_step_N`) whose actor is served as the
trainer serves it: the megatron-core actor is built at TP = `rollout.tp` (DP over the other ranks), reads its
shards, and its weights are resharded into an engine started with dummy weights (the checkpoint's `hf/` holds
config and tokenizer, no weight files).

Each replica generates for its share of the prompts; the responses are brought to rank 0, which writes one row
per response (.jsonl or .parquet). A trajectory's row holds the whole conversation (`messages`), and `response`
is its last assistant turn. `launchers/evaluate.py` re-scores the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from megarl.tracking.console import quiet_third_party_logs

quiet_third_party_logs()  # before the libraries are imported: some warn or log while importing
import torch.distributed as dist  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from megarl.checkpoint.model_loading import load_model, model_problem  # noqa: E402
from megarl.config import ConfigError, RunConfig, load_config  # noqa: E402
from megarl.data.dataset import load_rows, write_rows  # noqa: E402
from megarl.distributed import finish_process, init_layout  # noqa: E402
from megarl.distributed.launch import init_process_group  # noqa: E402
from megarl.doctor import MissingFeature, require  # noqa: E402
from megarl.generation import (  # noqa: E402
    EngineSettings,
    RolloutCollector,
    RolloutPolicy,
    Rollouts,
    move_responses,
    prompt_dataset,
    reward_manager,
    start_rollout_engine,
)
from megarl.messages import exit_on_user_error  # noqa: E402
from megarl.rollout import RolloutEngine  # noqa: E402
from megarl.tracking.timing import PhaseTimer  # noqa: E402


def parse_args(argv: list[str]) -> tuple[RunConfig, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a run's YAML file (e.g. under configs/)")
    parser.add_argument("--output", required=True, help="generations file: .jsonl or .parquet")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.path=... rollout.val_n=4")
    args = parser.parse_args(argv)
    if Path(args.output).suffix not in (".jsonl", ".parquet"):
        parser.error(f"--output {args.output}: expected a .jsonl or .parquet file")
    config = load_config(args.config, args.overrides)
    if not config.data.val_files:
        raise ConfigError("config key 'data.val_files' is empty; expected the parquet files of the prompts to answer")
    return config, Path(args.output)


@dataclass(frozen=True)
class ModelSource:
    hf_dir: Path
    """Config and tokenizer; also the weights when `checkpoint` is None."""
    checkpoint: Path | None
    """A megarl checkpoint whose actor supplies the weights."""


def model_source(path: str) -> ModelSource:
    """What `model.path` names: a HF directory (config.json) or a complete megarl checkpoint with an actor."""
    directory = Path(path)
    if (directory / "config.json").is_file():
        return ModelSource(directory, None)
    problem = model_problem(directory, "actor")
    if problem:
        raise ConfigError(f"config key 'model.path' = {path!r}: expected a HuggingFace model directory (with "
                          f"config.json) or a megarl checkpoint (global_step_N with an actor); not a checkpoint: "
                          f"{problem}")
    return ModelSource(directory / "hf", directory)


def start_engine(config: RunConfig, model: ModelSource) -> RolloutEngine:
    """Join the torchrun world and start the rollout engine with the model's weights. A checkpoint's actor gets
    the TP of the engine, so that every rank already holds the slices its engine rank needs, and is served as in
    training (`RolloutPolicy`)."""
    settings = EngineSettings.of_run(config, model_path=str(model.hf_dir))
    if model.checkpoint is None:
        init_process_group()
        return start_rollout_engine(settings, dummy_weights=False)
    layout = init_layout(tp=config.rollout.tp)
    actor, arch = load_model(model.checkpoint, "actor", layout, config.model.dtype)
    policy = RolloutPolicy(actor, arch, layout, settings)
    policy.enter_rollout(step=0, timer=PhaseTimer(step=0))
    return policy.engine


def output_rows(rollouts: Rollouts, n: int, raw_rows: list[dict], tokenizer) -> list[dict]:
    """One row per response; rollouts are prompt-major (sample j of prompt i at i * n + j). A trajectory's
    row has its conversation (the prompt's messages first when its environment kept them) and its last
    assistant turn as the response."""
    if not rollouts.messages:
        responses = tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
        conversations = [{} for _ in responses]
    else:
        conversations = [{"messages": _conversation(raw_rows[p.index]["prompt"], messages)}
                         for p, messages in zip(rollouts.prompts, rollouts.messages)]
        responses = [next(m["content"] for m in reversed(c["messages"]) if m["role"] == "assistant")
                     for c in conversations]
    return [{"data_source": prompt.data_source, "prompt": raw_rows[prompt.index]["prompt"], "response": response,
             "ground_truth": prompt.ground_truth, "score": score, "index": prompt.index, "sample": i % n,
             "finish_reason": reason, "extra_info": prompt.extra_info, **conversation}
            for i, (prompt, response, score, reason, conversation) in enumerate(zip(
                rollouts.prompts, responses, rollouts.scores, rollouts.finish_reasons, conversations))]


def _conversation(prompt: list[dict] | str, messages: list[dict]) -> list[dict]:
    """A trajectory's messages, after its prompt's when its environment opened with none of its own."""
    if messages and messages[0]["role"] != "assistant":
        return messages
    return ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)) + messages


def write_generations(rows: list[dict], path: Path) -> None:
    if path.suffix == ".parquet":
        write_rows(rows, path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)


def main(argv: list[str]) -> None:
    config, output = parse_args(argv)
    try:
        require(["core", "vllm"] if config.rollout.backend == "vllm" else ["core"])
    except MissingFeature as error:  # a missing package: one line with the fix
        sys.exit(str(error))
    model = model_source(config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model.hf_dir)
    dataset = prompt_dataset(config, tokenizer, config.data.val_files)
    rewards = reward_manager(config)
    engine = start_engine(config, model)
    rollouts = RolloutCollector(config, tokenizer, rewards).validation(engine, dataset)
    if config.rollout.multi_turn.enable:  # each replica's first rank holds its trajectories' messages
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, {i: m for i, m in enumerate(rollouts.messages) if m is not None})
        rollouts.messages = [next(part[i] for part in held if i in part) for i in range(len(rollouts))]
    everything_to_rank_0 = [list(range(len(rollouts)))] + [[] for _ in range(dist.get_world_size() - 1)]
    move_responses(rollouts, everything_to_rank_0, config.rollout.tp)
    if dist.get_rank() == 0:
        raw_rows = load_rows(config.data.val_files)
        write_generations(output_rows(rollouts, config.rollout.val_n, raw_rows, tokenizer), output)
        mean = sum(rollouts.scores) / len(rollouts.scores)
        print(f"wrote {len(rollouts)} responses to {len(set(rollouts.group_ids))} prompts to {output}; "
              f"mean score {mean:.4f}")
    engine.shutdown()
    finish_process()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ValueError as error:  # config, model, data and reward-function errors: one line naming the key or path
        exit_on_user_error(error)
