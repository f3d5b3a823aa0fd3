"""What an adapter multiplies when its linear is one of Transformer Engine's LayerNormLinear (the layer's norm fused
in): the input normalized as that norm normalizes it, against torch's own RMSNorm and LayerNorm. The linear is
described by the attributes TE's LayerNormLinear has (TE itself does not import on CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.models.lora import _linear_input

HIDDEN = 16


def _fused(normalization: str, zero_centered_gamma: bool) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(0)
    bias = torch.randn(HIDDEN, generator=generator) if normalization == "LayerNorm" else None
    return SimpleNamespace(layer_norm_weight=torch.randn(HIDDEN, generator=generator), layer_norm_bias=bias,
                           normalization=normalization, zero_centered_gamma=zero_centered_gamma, eps=1e-5)


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_a_fused_norm_linear_gives_its_adapter_the_normalized_input(normalization, zero_centered_gamma):
    linear = _fused(normalization, zero_centered_gamma)
    x = torch.randn(3, 2, HIDDEN, generator=torch.Generator().manual_seed(1)) * 4 + 1
    gamma = linear.layer_norm_weight + 1 if zero_centered_gamma else linear.layer_norm_weight
    if normalization == "RMSNorm":
        expected = torch.nn.functional.rms_norm(x, (HIDDEN,), gamma, linear.eps)
    else:
        expected = torch.nn.functional.layer_norm(x, (HIDDEN,), gamma, linear.layer_norm_bias, linear.eps)
    torch.testing.assert_close(_linear_input(linear, x), expected, rtol=1e-5, atol=1e-5)


def test_a_plain_linear_gives_its_adapter_its_input():
    x = torch.randn(3, HIDDEN)
    assert _linear_input(torch.nn.Linear(HIDDEN, 4), x) is x
