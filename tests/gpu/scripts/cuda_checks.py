"""One process on one GPU (checked by tests/gpu/test_cuda_checks.py; runs on CPU with gloo as well).

Reports (JSON, one `REPORT` line):
- the default process group megarl creates (`megarl.device.backend()`): `dist.all_reduce` and
  `dist.broadcast` of a tensor on the compute device and of a CPU tensor, and megarl's own
  `collectives.all_reduce` of a CPU tensor (the step's bookkeeping): values and devices after;
- the `hf` rollout engine fed by `WeightSync` from a MegatronEngine trained one step: its tensors
  against `export_hf` of the training model, bit for bit, and the device they live on; how many loads
  a second sync with no training in between runs (none: it copies into `weight_places`); after a
  second step and sync, the engine's log-probs of its greedy tokens against the trainer's, in fp32.
Only the `hf` half of tests/distributed/scripts/rollout_checks.py: vLLM is not imported.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import device
from megarl.distributed import collectives, finish_process, init_layout, split_world
from megarl.distributed.timeouts import collective_timeout
from megarl.models.hf_interop import export_hf
from megarl.resharding.executor import WeightSync
from megarl.rollout.base import Sampling
from megarl.rollout.hf_backend import HFRollout, checkpoint_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "distributed/scripts"))
from trained_actor import PROMPTS, make_actor, make_batch, read_safetensors, train_step  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--hf", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--values", type=float, nargs="+", required=True, help="what the collectives reduce")
args = parser.parse_args()

# fp32 GEMMs in full fp32 (no TF32) on the trainer and the engine alike: the log-prob bound is fp32's.
torch.set_float32_matmul_precision("highest")
layout = init_layout()
report = {"backend": str(dist.get_backend()), "compute_device": str(device.compute_device())}

# 1. The default group: a tensor on the compute device (NCCL on CUDA) and one on the CPU (gloo).
for where in ("compute", "cpu"):
    where_device = device.compute_device() if where == "compute" else torch.device("cpu")
    reduced = torch.tensor(args.values, device=where_device)
    dist.all_reduce(reduced)
    broadcast = torch.tensor(args.values, device=where_device)
    dist.broadcast(broadcast, src=0)
    report[f"{where}_all_reduce"], report[f"{where}_broadcast"] = reduced.tolist(), broadcast.tolist()
    report[f"{where}_devices_after"] = sorted({str(reduced.device), str(broadcast.device)})
bookkeeping = torch.tensor(args.values)
collectives.all_reduce(bookkeeping)
report["megarl_all_reduce"] = bookkeeping.tolist()
# Split placement's bridge between trainer and rollout ranks: an NCCL group of its own, with the run's timeout.
bridge = split_world._backend(dist.HashStore(), 0, 1)
report["bridge_timeout_s"], report["collective_timeout_s"] = (
    bridge.options._timeout.total_seconds(), collective_timeout().total_seconds())

# 2. Weight sync into the `hf` engine.
actor = make_actor(layout, args.hf)


def engine_equals_export(out_dir: str) -> bool:
    """Every tensor of `export_hf` of the training model, bit for bit in the engine (compared on the CPU)."""
    export_hf(actor.module, actor.arch, layout, out_dir, args.hf)
    exported, engine_state = read_safetensors(out_dir), engine.model.state_dict()
    return len(exported) > 0 and all(torch.equal(checkpoint_tensor(engine_state, name).cpu(), tensor)
                                     for name, tensor in exported.items())


train_step(actor, [[7, 8, 9, 10]] * 4)  # the weights now differ from the checkpoint
engine = HFRollout(args.hf, "float32")
sync = WeightSync(actor.module, actor.arch, layout, engine, 1, bucket_bytes=1 << 18)
loads = []  # engine.load_weights calls, per sync
load_weights = engine.load_weights


def counted_load(weights):
    loads[-1] += 1
    return load_weights(weights)


engine.load_weights = counted_load  # unchanged, only counted
for step in (1, 2):  # no training in between: the second sync copies into the places the first loaded
    loads.append(0)
    sync.sync(step=step)
    report[f"bit_identical_after_sync_{step}"] = engine_equals_export(os.path.join(args.out, f"sync{step}"))
checkpoint, synced = read_safetensors(args.hf), read_safetensors(os.path.join(args.out, "sync1"))
report["synced_differs_from_checkpoint"] = any(not torch.equal(synced[name], checkpoint[name]) for name in synced)
report["engine_param_devices"] = sorted({str(p.device) for p in engine.model.parameters()})
# The second sync copied into the engine's own parameters, not into tensors of its own.
storages = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
places = engine.weight_places() or {}
report["places_are_engine_params"] = len(places) > 0 and all(
    place.untyped_storage().data_ptr() in storages for place in places.values() if place is not None)

# A second step, then a sync (the copy again), then the engine's greedy tokens scored by the trainer.
greedy = Sampling(temperature=0.0, max_tokens=12)
train_step(actor, engine.generate(PROMPTS, greedy).response_ids)
loads.append(0)
sync.sync(step=3)
report["loads_per_sync"] = loads
report["bit_identical_after_sync_3"] = engine_equals_export(os.path.join(args.out, "sync3"))
generated = engine.generate(PROMPTS, greedy)
# The `hf` engine's greedy log-probs are of the unscaled distribution: the trainer's at temperature 1.
trainer_logprobs = actor.score(make_batch(generated.response_ids), temperature=1.0)["logprobs"]
report["tokens_scored"] = sum(map(len, generated.logprobs))
report["engine_vs_trainer_logprob_diff"] = max(
    abs(float(trainer_logprobs[i, j]) - logprob) for i, row in enumerate(generated.logprobs)
    for j, logprob in enumerate(row))

print("REPORT " + json.dumps(report), flush=True)
finish_process()
