"""Megatron at TP1, TP2, PP2 and TP2xPP2 against `transformers`, and HF -> Megatron -> HF round trips.

Each layout is one real torchrun launch of the `compare_logits.py` tool over every tiny model
(Llama, Qwen2, Qwen3; tied and untied; a value model; a 101-token vocabulary, padded for TP).
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, TINY_MODELS, assert_succeeded, torchrun

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{tp}pp{pp}" for tp, pp in LAYOUTS])
def test_logits_match_transformers(tiny_models, tp, pp):
    result = torchrun(tp * pp, ROOT / "checkpoints_tools/compare_logits.py",
                      "--hf", *tiny_models.values(), "--tp", tp, "--pp", pp, "--tolerance", "1e-4")
    assert_succeeded(result)
    differences = [float(d) for d in re.findall(r"^OK .* = (\S+) ", result.stdout, re.MULTILINE)]
    assert len(differences) == len(TINY_MODELS), result.stdout
    assert max(differences) <= 1e-4


def _read_all(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_hf_roundtrip_through_tp2_pp2_is_bit_identical(tiny_models, tmp_path):
    result = torchrun(4, ROOT / "tests/distributed/scripts/hf_roundtrip.py",
                      "--tp", 2, "--pp", 2, "--out", tmp_path, "--hf", *tiny_models.values())
    assert_succeeded(result)
    for name, source_dir in tiny_models.items():
        source, exported = _read_all(source_dir), _read_all(tmp_path / name)
        assert sorted(exported) == sorted(source), name
        for tensor_name, tensor in source.items():
            assert torch.equal(exported[tensor_name], tensor), f"{name}: {tensor_name} differs"
        assert (tmp_path / name / "model.safetensors.index.json").is_file()  # one shard per stage
