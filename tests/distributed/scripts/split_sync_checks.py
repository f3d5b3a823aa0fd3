"""Split placement's cross-group weight sync (checked by tests/distributed/test_split_sync.py).

A TP2 trainer (ranks 0, 1) trains one step, so its weights differ from the checkpoint, and syncs
them to two `hf` engines on the rollout ranks (2, 3): the first fed by the trainers, the second by
broadcast from it. Each rollout rank writes a JSON report: its engine's weights against the HF
export of the trained model, and the bytes it received against the bytes of that export.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from megarl.config.schema import EngineConfig, ModelConfig, OptimizerConfig
from megarl.distributed import finish_process, init_layout
from megarl.distributed.split_world import join_split_world
from megarl.engine.batch import SequenceBatch
from megarl.engine.megatron_engine import MegatronEngine
from megarl.models.hf_interop import export_hf
from megarl.resharding.cross_group import CrossGroupSync
from megarl.rollout.hf_backend import HFRollout, checkpoint_tensor

parser = argparse.ArgumentParser()
parser.add_argument("--hf", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
out, bucket_bytes = Path(args.out), 64 << 10  # several buckets

world = join_split_world(num_rollout_ranks=2)
if world.is_trainer:
    layout = init_layout(tp=2)
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
if not world.is_trainer:
    exported = {}
    for file in (out / "hf").glob("*.safetensors"):
        exported.update(load_file(file))
    engine_state = engine.model.state_dict()
    report = {
        "fed_by": "trainers" if world.rank == world.first_rollout_rank else "broadcast",
        "bit_identical": all(torch.equal(checkpoint_tensor(engine_state, n), t) for n, t in exported.items()),
        "tensors": len(exported),
        "bytes_received": stats.bytes_received,
        "lower_bound": stats.lower_bound,
        "export_bytes": sum(t.numel() * t.element_size() for t in exported.values()),
        "buckets": len(sync.buckets),
    }
    (out / f"report_{world.rank}.json").write_text(json.dumps(report))
finish_process()
