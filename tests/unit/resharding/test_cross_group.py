"""Split placement's weight sync allocates what the rollout ranks receive on the device the bridge's
backend takes (`megarl.device.compute_device`): on CUDA the bridge is an NCCL group, which takes CUDA
tensors only. No processes: a recording bridge, and a stand-in device (meta) for the answer."""

from __future__ import annotations

import pytest
import torch

from megarl import device
from megarl.models.architecture import Architecture
from megarl.resharding.cross_group import CrossGroupSync
from megarl.resharding.plan import SourcePiece

ARCH = Architecture(
    family="qwen2", value_model=False, num_layers=1, hidden_size=4, num_attention_heads=2, num_kv_heads=1,
    head_dim=2, ffn_hidden_size=6, vocab_size=8, max_position_embeddings=16, rope_theta=1e4, rope_type="default",
    rope_factor=1.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=False, qk_norm=False,
    initializer_range=0.02,
)
DOWN, NORM = "model.layers.0.mlp.down_proj.weight", "model.norm.weight"
# Trainer ranks 0 and 1 hold the down projection's columns split over TP2 (each half lands in a
# non-contiguous slice of the engine's tensor: received into a buffer of its own, then copied) and the norm whole.
SOURCES = [SourcePiece(0, DOWN, 1, 0, 3, "decoder.layers.0.mlp.linear_fc2.weight", 0),
           SourcePiece(1, DOWN, 1, 3, 6, "decoder.layers.0.mlp.linear_fc2.weight", 0),
           SourcePiece(0, NORM, 0, 0, 4, "decoder.final_layernorm.weight", 0),
           SourcePiece(1, NORM, 0, 0, 4, "decoder.final_layernorm.weight", 0)]
SHAPES = {DOWN: (4, 6), NORM: (4,)}
DESCRIBED = (ARCH, [SOURCES], [], SHAPES, dict.fromkeys(SHAPES, torch.float32))


class _Done:
    def wait(self) -> None:
        pass


class RecordingGroup:
    """A process group that records the tensors it is handed to fill."""

    def __init__(self):
        self.filled: list[torch.Tensor] = []

    def recv(self, tensors, src, tag):
        self.filled += tensors
        return _Done()

    def broadcast(self, tensor, root):
        self.filled.append(tensor)
        return _Done()


class RolloutRankWorld:
    """Split placement's world of two trainer and two rollout ranks, seen from rollout rank `rank`."""

    num_trainer_ranks = first_rollout_rank = num_rollout_ranks = 2
    is_trainer = False

    def __init__(self, rank: int):
        self.rank, self.bridge, self.position_group = rank, RecordingGroup(), RecordingGroup()

    def broadcast_object(self, value, root):
        return DESCRIBED

    def bridge_group(self, ranks):
        return self.position_group


class RecordingEngine:
    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def begin_weight_update(self, step):
        pass

    def load_weights(self, weights):
        self.loaded.update(weights)

    def end_weight_update(self):
        pass


@pytest.mark.parametrize("rank", [2, 3], ids=["from the trainers", "by broadcast from the first replica"])
def test_rollout_ranks_receive_into_the_bridge_backends_device(monkeypatch, rank):
    on = torch.device("meta")  # stands in for the rank's GPU: any device but the CPU shows the choice
    monkeypatch.setattr(device, "compute_device", lambda: on)
    world, engine = RolloutRankWorld(rank), RecordingEngine()
    CrossGroupSync(world, 1, bucket_bytes=1 << 20, engine=engine).sync(step=1)
    received = world.bridge.filled if rank == 2 else world.position_group.filled
    assert len(received) == (3 if rank == 2 else 2)  # two column halves and the norm; or the two whole tensors
    assert all(tensor.device == on for tensor in received + list(engine.loaded.values()))
    assert sorted(engine.loaded) == sorted(SHAPES)
