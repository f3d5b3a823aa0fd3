"""`actor.offload`/`critic.offload` on one GPU: PPO (actor, reference, critic) in bf16 with the distributed
optimizer, offload off then on in one process (tests/distributed/scripts/offload_checks.py), held to what
the CPU test holds it to: metrics, final weights and optimizer states bitwise equal (one process, the same
kernels on the same bytes), and no CUDA memory held by the actor, reference or critic while the engine is
created and generates (the actor's parameters alone during the weight sync)."""

from __future__ import annotations

import pytest

from tests.conftest import torchrun
from tests.distributed.test_offload import SCRIPT, assert_offload_report, offload_args

pytestmark = pytest.mark.gpu


def test_offload_to_host_and_back_keeps_training_bitwise(tiny_models, tmp_path):
    assert_offload_report(torchrun(1, SCRIPT, *offload_args(tiny_models, tmp_path), "model.dtype=bfloat16"))
