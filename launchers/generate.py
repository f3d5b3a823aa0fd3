"""Generate n responses per prompt of a parquet file with the training rollout engine, and score them.

    torchrun --nproc_per_node=N launchers/generate.py --model HF_DIR|CHECKPOINT --data test.parquet \
        --output generations.jsonl [-n 4 --temperature 1.0 --backend vllm --engine-tp 1]

--model is a HuggingFace directory, or a megarl checkpoint (`global_step_N`) whose actor is loaded
the way the trainer feeds its rollout engine: the megatron-core actor is built at TP = --engine-tp
(DP over the other ranks), reads its shards, and `WeightSync` reshards them into an engine started
with dummy weights (a checkpoint's `hf/` holds config and tokenizer, no weight files).

The prompts are read and tokenized as in training (`PromptDataset`: common parquet layout, chat
template, with --multi-turn the tools preamble, prompts over --max-prompt-length dropped). Each engine replica (--engine-tp consecutive
ranks) generates for its share of the prompts and `collect_rollouts` scores the responses, exactly
as the trainer's validation does; `move_responses` brings them to rank 0, which writes one row per
response (.jsonl or .parquet). The defaults (greedy, one sample, seed 1) are the trainer's validation
defaults, so `launchers/evaluate.py` on the output reproduces `val/score/mean` for the same model.

With --multi-turn each sample is a trajectory with tools or an environment, generated as the trainer's
multi-turn rollouts (`megarl.trainer.multi_turn`): its row holds the whole conversation (`messages`), and
`response` is its last assistant turn. Its `score` comes from --multi-turn-reward (rollout.multi_turn.reward:
the environment's reward, the reward function's score of `response`, which evaluate.py re-scores, or both).
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

from megarl.agent.tools import tool_schemas  # noqa: E402
from megarl.checkpoint.model_loading import load_model, model_problem  # noqa: E402
from megarl.config.schema import MULTI_TURN_REWARDS, MultiTurnConfig, RolloutConfig  # noqa: E402
from megarl.data.dataset import load_rows, write_rows  # noqa: E402
from megarl.data.prompt_dataset import PromptDataset  # noqa: E402
from megarl.distributed import init_layout  # noqa: E402
from megarl.distributed.launch import finish_process, init_process_group  # noqa: E402
from megarl.doctor import MissingFeature, require  # noqa: E402
from megarl.rewards import RewardManager, load_scoring_function  # noqa: E402
from megarl.rollout import ROLLOUT_BACKENDS, RolloutEngine, Sampling  # noqa: E402
from megarl.seeding import derive_seed  # noqa: E402
from megarl.trainer.multi_turn import MultiTurnRollouts  # noqa: E402
from megarl.trainer.policy import EngineSettings, RolloutPolicy  # noqa: E402
from megarl.trainer.rollouts import Rollouts, collect_rollouts, move_responses  # noqa: E402
from megarl.trainer.startup import exit_on_user_error  # noqa: E402
from megarl.trainer.timing import PhaseTimer  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a HuggingFace model directory, or a megarl checkpoint "
                        "(global_step_N) whose actor is resharded into the engine as in training")
    parser.add_argument("--data", required=True, nargs="+", help="parquet file(s) of prompts in the common layout")
    parser.add_argument("--output", required=True, help="generations file: .jsonl or .parquet")
    # Not "--n": torchrun reads it as an abbreviation of its own --nnodes/--nproc-per-node.
    parser.add_argument("-n", "--num-samples", type=int, default=1, help="responses per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1 disables")
    parser.add_argument("--max-response-length", type=int, default=64)
    parser.add_argument("--max-prompt-length", type=int, default=128, help="longer prompts are dropped")
    parser.add_argument("--max-samples", type=int, default=0, help="use the first this-many prompts (0: all)")
    parser.add_argument("--apply-chat-template", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--backend", default="vllm", choices=ROLLOUT_BACKENDS.names())
    parser.add_argument("--engine-tp", type=int, default=1, help="tensor-parallel size of each engine replica")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="KV cache of each engine on CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--reward-function", default="", help="path/to/file.py:function or "
                        "pkg.module:function; default: the rule scorers by data_source")
    parser.add_argument("--multi-turn", action="store_true", help="trajectories with tools or an environment")
    parser.add_argument("--tools", nargs="*", default=MultiTurnConfig().tools, help="--multi-turn: built-in tool "
                        "names and path/to/file.py:function (rollout.multi_turn.tools)")
    parser.add_argument("--environment", default="", help="--multi-turn: path/to/file.py:Class answering every "
                        "trajectory (rollout.multi_turn.environment); default: by data_source, else the tools")
    parser.add_argument("--multi-turn-reward", default=MultiTurnConfig().reward, choices=MULTI_TURN_REWARDS,
                        help="--multi-turn: where a trajectory's score comes from (rollout.multi_turn.reward)")
    parser.add_argument("--max-turns", type=int, default=MultiTurnConfig().max_turns, help="--multi-turn: model "
                        "turns per trajectory at most")
    parser.add_argument("--max-tokens-per-turn", type=int, default=0, help="--multi-turn: tokens of one model turn "
                        "at most (0: what is left of --max-response-length, which counts every response token)")
    args = parser.parse_args(argv)
    if Path(args.output).suffix not in (".jsonl", ".parquet"):
        parser.error(f"--output {args.output}: expected a .jsonl or .parquet file")
    return args


@dataclass(frozen=True)
class ModelSource:
    hf_dir: Path
    """Config and tokenizer; also the weights when `checkpoint` is None."""
    checkpoint: Path | None
    """A megarl checkpoint whose actor supplies the weights."""


def model_source(path: str) -> ModelSource:
    """What --model names: a HF directory (config.json) or a complete megarl checkpoint with an actor."""
    directory = Path(path)
    if (directory / "config.json").is_file():
        return ModelSource(directory, None)
    problem = model_problem(directory, "actor")
    if problem:
        raise ValueError(f"--model {path}: expected a HuggingFace model directory (with config.json) or a megarl "
                         f"checkpoint (global_step_N with an actor); not a checkpoint: {problem}")
    return ModelSource(directory / "hf", directory)


def start_engine(args: argparse.Namespace, model: ModelSource) -> RolloutEngine:
    """Join the torchrun world and start the rollout engine with the model's weights. A checkpoint's
    actor gets the TP of the engine, so that every rank already holds the slices its engine rank needs,
    and is served as in training (`RolloutPolicy`)."""
    if model.checkpoint is None:
        init_process_group()
        return ROLLOUT_BACKENDS.get(args.backend)(
            str(model.hf_dir), dtype=args.dtype, tensor_parallel_size=args.engine_tp,
            max_model_len=args.max_prompt_length + args.max_response_length, kv_cache_bytes=args.kv_cache_mib << 20,
            gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed, dummy_weights=False)
    layout = init_layout(tp=args.engine_tp)
    actor, arch = load_model(model.checkpoint, "actor", layout, args.dtype)
    settings = EngineSettings(args.backend, str(model.hf_dir), args.dtype, args.engine_tp,
                              args.max_prompt_length + args.max_response_length, args.kv_cache_mib << 20,
                              args.gpu_memory_utilization, args.seed, RolloutConfig.bucket_mib << 20)
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
    args = parse_args(argv)
    try:
        require(["core", "vllm"] if args.backend == "vllm" else ["core"])
    except MissingFeature as error:  # a missing package: one line with the fix
        sys.exit(str(error))
    model = model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model.hf_dir)
    turns = MultiTurnConfig(enable=args.multi_turn, tools=args.tools, environment=args.environment,
                            reward=args.multi_turn_reward, max_turns=args.max_turns,
                            max_tokens_per_turn=args.max_tokens_per_turn)
    dataset = PromptDataset(args.data, tokenizer, args.max_prompt_length, args.apply_chat_template,
                            tools=tool_schemas(turns))
    prompts = [dataset[i] for i in range(min(args.max_samples or len(dataset), len(dataset)))]
    engine = start_engine(args, model)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    sampling = Sampling(n=args.num_samples, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_response_length, stop_token_ids=stop,
                        seed=derive_seed(args.seed, "validation"))  # the trainer's validation stream
    rewards = RewardManager(load_scoring_function(args.reward_function, "--reward-function"))
    if args.multi_turn:
        collector = MultiTurnRollouts.from_config(RolloutConfig(tp=args.engine_tp, multi_turn=turns), tokenizer,
                                                  args.max_prompt_length, args.max_response_length)
        rollouts = collector.collect(prompts, engine, sampling, rewards)
        held = [None] * dist.get_world_size()  # each replica's first rank holds its trajectories' messages
        dist.all_gather_object(held, {i: m for i, m in enumerate(rollouts.messages) if m is not None})
        rollouts.messages = [next(part[i] for part in held if i in part) for i in range(len(rollouts))]
    else:
        rollouts = collect_rollouts(prompts, engine, sampling, args.engine_tp, tokenizer, rewards)
    everything_to_rank_0 = [list(range(len(rollouts)))] + [[] for _ in range(dist.get_world_size() - 1)]
    move_responses(rollouts, everything_to_rank_0, args.engine_tp)
    if dist.get_rank() == 0:
        write_generations(output_rows(rollouts, args.num_samples, load_rows(args.data), tokenizer), Path(args.output))
        mean = sum(rollouts.scores) / len(rollouts.scores)
        print(f"wrote {len(rollouts)} responses to {len(prompts)} prompts to {args.output}; mean score {mean:.4f}")
    engine.shutdown()
    finish_process()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ValueError as error:  # model, data and reward-function errors: one line naming the path
        exit_on_user_error(error)
