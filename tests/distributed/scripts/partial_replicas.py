"""Partial rollouts over engine replicas in lockstep (checked by tests/distributed/test_partial_replicas.py).

Every process is a rollout rank holding an `hf` engine replica (rollout.tp=1) of the same model; they make
three batches, the weights updated between them as a sync would (the requests kept in the engines through the
second, as rollout.keep_kv keeps them), and take the state a checkpoint would hold a few engine steps into each
next batch, requests running. Each rank writes the batches and those states as it holds them, and how many
requests its own engine was given. Config overrides (a multi-turn environment) come after the arguments.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config.loader import load_config
from megarl.generation.inputs import RunInputs
from megarl.generation.partial import PartialRollouts
from megarl.rollout.hf_backend import HFRollout

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--train", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("overrides", nargs="*")
args = parser.parse_args()
dist.init_process_group("gloo")


class CountingEngine(HFRollout):
    """The `hf` engine, counting the requests submitted to it."""

    submits = 0

    def submit(self, key, prompt, sampling):
        self.submits += 1
        super().submit(key, prompt, sampling)


config = load_config(str(Path(__file__).resolve().parents[3] / "configs/quickstart.yaml"), [
    f"model.path={args.model}", f"data.train_files=[{args.train}]", f"data.val_files=[{args.train}]",
    "trainer.placement=split", f"rollout.num_ranks={dist.get_world_size()}", "trainer.max_staleness=2",
    "rollout.backend=hf", "rollout.partial=true", "data.max_response_length=12", "data.train_batch_size=3",
    "rollout.n=2", "rollout.partial_groups=4", *args.overrides])
inputs = RunInputs.open(config)
engine = CountingEngine(config.model.path, "float32")
partial = PartialRollouts(config, inputs.tokenizer, inputs.rewards, inputs.train_data, inputs.sampler, engine)
batches, states = [], []
for step in (1, 2, 3):
    rollouts, indices, metrics = partial.take(step, version=step - 1)
    batches.append({"indices": indices, "response_ids": rollouts.response_ids, "logprobs": rollouts.rollout_logprobs,
                    "versions": rollouts.token_versions, "scores": rollouts.scores, "metrics": metrics})
    for _ in range(3):
        partial.advance(step + 1, version=step - 1)
    states.append(partial.state_dict())  # as a checkpoint takes it: every rollout rank at once, requests running
    partial.fill(step + 1, version=step - 1)
    partial.pause(keep=step == 2)
    generator = torch.Generator().manual_seed(step)  # the same new weights on every replica, as a sync brings
    engine.begin_weight_update(step)
    engine.load_weights([(name, p.detach() + 0.1 * torch.randn(p.shape, generator=generator))
                         for name, p in engine.model.named_parameters()])
    engine.end_weight_update()
with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as file:
    json.dump({"batches": batches, "states": states, "submits": engine.submits}, file)
dist.destroy_process_group()
