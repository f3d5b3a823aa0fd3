"""Float32 products through oneDNN where it is the faster kernel, torch's own everywhere else."""

from __future__ import annotations

import pytest
import torch

from megarl.kernels import cpu_matmul

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _random(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("case", ["forward", "input gradient", "weight gradient", "3-D with bias"])
def test_onednn_products_equal_float64_ones(case):
    # The three products of a linear layer's step, with the strides megatron's forward and backward give them.
    x, weight, grad = _random(48, 128), _random(96, 128, seed=1), _random(48, 96, seed=2)
    a, b, bias = {"forward": (x, weight, None), "input gradient": (grad, weight.t(), None),
                  "weight gradient": (grad.t(), x.t(), None),
                  "3-D with bias": (x.view(4, 12, 128), weight, _random(96, seed=3))}[case]
    expected = torch.nn.functional.linear(a, b, bias)
    result = cpu_matmul.onednn_linear(a.float(), b.float(), None if bias is None else bias.float())
    torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-4)


def test_products_take_onednn_only_where_it_is_faster():
    x, weight = _random(48, 128).float(), _random(96, 128, seed=1).float()
    faster = cpu_matmul.onednn_faster()
    for result in (cpu_matmul.linear(x, weight), cpu_matmul.matmul(x, weight.t())):
        expected = cpu_matmul.onednn_linear(x, weight) if faster else torch.nn.functional.linear(x, weight)
        assert torch.equal(result, expected)
    # torch's own, bitwise: a few rows, another dtype, an empty inner dimension.
    few = x[: cpu_matmul.MIN_ROWS - 1]
    assert torch.equal(cpu_matmul.linear(few, weight), torch.nn.functional.linear(few, weight))
    assert torch.equal(cpu_matmul.matmul(x.double(), weight.double().t()), x.double() @ weight.double().t())
    assert cpu_matmul.matmul(torch.ones(48, 0), torch.ones(0, 5)).eq(0).all()


def test_a_cpu_without_avx512_keeps_torchs_products(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    cpu_matmul.onednn_faster.cache_clear()
    try:
        assert not cpu_matmul.onednn_faster()
    finally:
        monkeypatch.undo()
        cpu_matmul.onednn_faster.cache_clear()


def test_a_product_whose_gradient_is_needed_stays_with_autograd():
    x = _random(48, 128).float().requires_grad_()
    weight = _random(96, 128, seed=1).float()
    cpu_matmul.matmul(x, weight.t()).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(48, 128))
