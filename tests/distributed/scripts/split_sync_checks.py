"""Split placement's bridge (checked by tests/distributed/test_split_sync.py): weights out, a batch in.

Two DP ranks of a TP1 trainer (ranks 0, 1) of a mixture-of-experts model train one step, so their weights
differ from the checkpoint, and sync them to three `hf` engines on the rollout ranks (2, 3, 4): the first two
fed by one trainer DP replica each (experts included: at EP1 each DP rank is an expert replica too), the
third by broadcast from the first. Then the first rollout rank sends a multi-turn batch
(3 prompts x 2 trajectories), of which trainer rank r wants the sequences WANTED[r]. Each rank writes a
JSON report: a rollout rank its engine's weights against the HF export of the trained model and the bytes
it received against the bytes of that export; a trainer rank the bytes it sent and the batch as it holds it.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from megarl.config.schema import EngineConfig, ModelConfig, OptimizerConfig
from megarl.data.dataset import Prompt
from megarl.distributed import finish_process, init_layout
from megarl.distributed.split_world import join_split_world
from megarl.engine.batch import SequenceBatch
from megarl.engine.megatron_engine import MegatronEngine
from megarl.generation.rollouts import Rollouts
from megarl.models.hf_interop import export_hf
from megarl.placement.batches import BatchBridge, batch_payload
from megarl.resharding.cross_group import CrossGroupSync
from megarl.rollout.hf_backend import HFRollout, checkpoint_tensor

WANTED = [[0, 2, 5], [1, 3, 4]]
N = 2
LENGTHS = [3, 1, 4, 2, 5, 2]

parser = argparse.ArgumentParser()
parser.add_argument("--hf", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
out, bucket_bytes = Path(args.out), 64 << 10  # several buckets

world = join_split_world(num_rollout_ranks=3)
if world.is_trainer:
    layout = init_layout()
    actor = MegatronEngine(layout, ModelConfig(path=args.hf), EngineConfig(micro_batch_size_per_rank=4,
                           optim=OptimizerConfig(lr=3e-3)), total_optimizer_steps=1)
    tokens = torch.randint(5, 100, (4, 12), generator=torch.Generator().manual_seed(1))
    batch = SequenceBatch(tokens, torch.full((4,), 6), torch.full((4,), 6))

    def nll(outputs, micro_batch, normalizer):
        return -(outputs["logprobs"] * micro_batch.response_mask_BR).sum() / normalizer.num_tokens, {}

    actor.train_mini_batch(batch, nll)
    sync = CrossGroupSync(world, 1, bucket_bytes, trainer=(actor.module, actor.arch, layout))
    stats = sync.sync(step=1)
    export_hf(actor.module, actor.arch, layout, str(out / "hf"), args.hf)
else:
    engine = HFRollout(args.hf, dtype="float32", dummy_weights=True)
    sync = CrossGroupSync(world, 1, bucket_bytes, engine=engine)
    stats = sync.sync(step=1)
world.broadcast_object(None, root=0)  # the export is written

prompts = [Prompt([7, 8, 9 + i], "test", "", {}, i) for i in range(3)]
bridge = BatchBridge(world, prompts, N)
if world.is_trainer:
    header, rollouts = bridge.receive()
    bridge.move(rollouts, WANTED)
    report = {"bytes_sent": stats.bytes_sent, "response_ids": rollouts.response_ids,
              "logprobs": rollouts.rollout_logprobs, "loss_masks": rollouts.loss_masks,
              "openings": rollouts.openings, "opening_lengths": rollouts.opening_lengths, "scores": rollouts.scores,
              "staleness": header["staleness"], "multi_version_responses": header["multi_version_responses"]}
else:
    generator = torch.Generator().manual_seed(0)
    openings = [[1] * (2 + i) for i in range(len(LENGTHS))]  # multi-turn: each trajectory's own
    sent = Rollouts(prompts=[prompts[i // N] for i in range(len(LENGTHS))], openings=openings,
                    opening_lengths=list(map(len, openings)),
                    group_ids=[i // N for i in range(len(LENGTHS))], replicas=[0] * len(LENGTHS),
                    response_lengths=LENGTHS,
                    response_ids=[torch.randint(0, 1000, (n,), generator=generator).tolist() for n in LENGTHS],
                    rollout_logprobs=[(-torch.rand(n, generator=generator, dtype=torch.float64)).tolist()
                                      for n in LENGTHS],
                    loss_masks=[[1] + [0] * (n - 1) for n in LENGTHS], finish_reasons=["stop"] * len(LENGTHS),
                    scores=[float(i) for i in range(len(LENGTHS))],
                    token_versions=[[0] + [1] * (n - 1) for n in LENGTHS])
    payload = batch_payload(sent, step=2, indices=[0, 1, 2], metrics={})
    bridge.send(payload)
    exported = {}
    for file in (out / "hf").glob("*.safetensors"):
        exported.update(load_file(file))
    engine_state = engine.model.state_dict()
    report = {
        "fed_by": "trainers" if any(sync.bucket_transfers) else "broadcast",
        "bit_identical": all(torch.equal(checkpoint_tensor(engine_state, n), t) for n, t in exported.items()),
        "tensors": len(exported),
        "bytes_received": stats.bytes_received,
        "lower_bound": stats.lower_bound,
        "export_bytes": sum(t.numel() * t.element_size() for t in exported.values()),
        "buckets": len(sync.buckets),
        "sent": payload,
    }
(out / f"report_{world.rank}.json").write_text(json.dumps(report))
finish_process()
