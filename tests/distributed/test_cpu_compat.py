"""Each CPU bridge for megatron-core is needed: its megatron path passes with it and fails without."""

from __future__ import annotations

import pytest

from megarl.distributed.cpu_compat import BRIDGES
from tests.conftest import ROOT, assert_succeeded, torchrun

SCRIPT = ROOT / "tests/distributed/scripts/cpu_compat_scenarios.py"


def _models(tiny_models, tiny_moe_models):
    return "--hf", tiny_models["qwen2-tied"], "--moe", tiny_moe_models["qwen2-moe"]


def test_every_scenario_passes_with_all_bridges(tiny_models, tiny_moe_models):
    result = torchrun(2, SCRIPT, *_models(tiny_models, tiny_moe_models))
    assert_succeeded(result)
    for name in [bridge.name for bridge in BRIDGES] + ["faster_matmuls", "faster_collectives"]:
        assert f"PASS {name}" in result.stdout


@pytest.mark.parametrize("bridge", BRIDGES, ids=[b.name for b in BRIDGES])
def test_scenario_fails_without_its_bridge(tiny_models, tiny_moe_models, bridge):
    result = torchrun(2, SCRIPT, *_models(tiny_models, tiny_moe_models), "--skip", bridge.name, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if line.startswith(f"ERROR {bridge.name}:")]
    assert errors, result.stdout + result.stderr[-3000:]
    assert bridge.symptom in errors[0].lower(), errors[0]
