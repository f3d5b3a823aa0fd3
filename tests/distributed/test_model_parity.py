"""Megatron at TP1, TP2, PP2 and TP2xPP2 against `transformers`, and HF -> Megatron -> HF round trips.

Each layout is one real torchrun launch of the `compare_logits.py` tool over every tiny model
(Llama, Qwen2, Qwen3; tied and untied; a value model; a 101-token vocabulary, padded for TP).
The mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, a value model) run at EP2, TP2xEP2
(each expert split over two ranks too) and PP2xEP2; their round trip goes through TP2xPP2xEP2 with
unsplit experts (ETP1) in the dense models' launch.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, assert_succeeded, torchrun

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MOE_LAYOUTS = [(1, 1, 2), (2, 1, 2), (1, 2, 2)]


def _assert_logits_match(models: dict, tp: int, pp: int, ep: int) -> None:
    # Experts are split like the rest (ETP = TP), so EP needs ep times the dense layout's ranks.
    result = torchrun(tp * pp * ep, ROOT / "checkpoints_tools/compare_logits.py",
                      "--hf", *models.values(), "--tp", tp, "--pp", pp, "--ep", ep, "--tolerance", "1e-4")
    assert_succeeded(result)
    differences = [float(d) for d in re.findall(r"^OK .* = (\S+) ", result.stdout, re.MULTILINE)]
    assert len(differences) == len(models), result.stdout
    assert max(differences) <= 1e-4


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{tp}pp{pp}" for tp, pp in LAYOUTS])
def test_logits_match_transformers(tiny_models, tp, pp):
    _assert_logits_match(tiny_models, tp, pp, ep=1)


@pytest.mark.parametrize("tp,pp,ep", MOE_LAYOUTS, ids=[f"tp{tp}pp{pp}ep{ep}" for tp, pp, ep in MOE_LAYOUTS])
def test_moe_logits_match_transformers(tiny_moe_models, tp, pp, ep):
    _assert_logits_match(tiny_moe_models, tp, pp, ep)


def _read_all(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_hf_roundtrip_through_tp2_pp2_is_bit_identical(tiny_models, tiny_moe_models, tmp_path):
    models = {**tiny_models, **tiny_moe_models}
    result = torchrun(4, ROOT / "tests/distributed/scripts/hf_roundtrip.py", "--tp", 2, "--pp", 2,
                      "--ep", 2, "--etp", 1, "--out", tmp_path, "--hf", *models.values())
    assert_succeeded(result)
    for name, source_dir in models.items():
        source, exported = _read_all(source_dir), _read_all(tmp_path / name)
        assert sorted(exported) == sorted(source), name
        for tensor_name, tensor in source.items():
            assert torch.equal(exported[tensor_name], tensor), f"{name}: {tensor_name} differs"
        assert (tmp_path / name / "model.safetensors.index.json").is_file()  # one shard per stage
