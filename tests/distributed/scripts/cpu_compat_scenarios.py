"""Megatron code paths that each CPU bridge guards, run in a 2-process gloo world.

    torchrun --nproc_per_node=2 cpu_compat_scenarios.py --hf DIR --moe DIR [--skip BRIDGE]

With every bridge applied all scenarios must pass; with `--skip B` the scenario of bridge B must
fail (that is what makes the bridge necessary). Prints `PASS <scenario>` or `ERROR <scenario>: ...`.
"""

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--hf", required=True, help="a tiny tied HF model")
parser.add_argument("--moe", required=True, help="a tiny mixture-of-experts HF model")
parser.add_argument("--skip", default=None, help="leave this bridge out and run only its scenario")
args = parser.parse_args()

from megarl.distributed import cpu_compat  # noqa: E402

cpu_compat.apply_cpu_compat(skip=[args.skip] if args.skip else [])

from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32  # noqa: E402
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region  # noqa: E402

from megarl.checkpoint.optimizer_state import initialize_optimizer_state, sharded_optimizer_state  # noqa: E402
from megarl.distributed import init_layout  # noqa: E402
from megarl.engine.forward import forward_outputs  # noqa: E402
from megarl.models.architecture import architecture_from_hf, read_hf_config  # noqa: E402
from megarl.models.builder import MoESettings, build_model  # noqa: E402
from reporting import write_line  # noqa: E402

arch = architecture_from_hf(read_hf_config(args.hf))
moe_arch = architecture_from_hf(read_hf_config(args.moe))
tokens_BT = torch.randint(0, arch.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))


def rng_tracker():
    init_layout(tp=2)  # seeds megatron's tensor-parallel RNG tracker


def current_device():
    layout = init_layout(tp=2)
    model = build_model(arch, layout)
    positions_BT = torch.arange(tokens_BT.shape[1]).expand_as(tokens_BT)
    model(tokens_BT, positions_BT, attention_mask=None)  # RoPE frequencies, attention buffers


def cuda_factories():
    layout = init_layout(tp=2)
    forward_outputs(build_model(arch, layout), layout, tokens_BT, micro_batch_size=1)


def synchronize():
    layout = init_layout(pp=2)
    forward_outputs(build_model(arch, layout), layout, tokens_BT, micro_batch_size=1)


def tensor_cuda():
    assert arch.tie_word_embeddings
    build_model(arch, init_layout(pp=2))  # last stage copies the tied embedding


def clip_grads_type():
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 2.0)
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(param.grad, torch.full((4,), 0.5), atol=1e-5)


def optimizer_type():
    distributed_optimizer()


def distributed_optimizer():
    layout = init_layout(tp=1)  # DP=2: the distributed optimizer shards the state over both ranks
    model = build_model(arch, layout)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), [ddp]
    )
    return model, optimizer


def optimizer_gather_cuda():
    model, optimizer = distributed_optimizer()
    initialize_optimizer_state(optimizer)
    for state in optimizer.chained_optimizers[0].optimizer.state.values():
        state["exp_avg"].fill_(dist.get_rank() + 1.0)  # this rank's shard of the state
    saved = sharded_optimizer_state(optimizer, model.sharded_state_dict(), is_loading=False)["param_state"]
    # Gathered over both DP ranks: every parameter's whole state, in the parameter's own shape.
    assert sorted(s["exp_avg"].data.shape for s in saved.values()) == sorted(p.shape for p in model.parameters())
    gathered = torch.cat([s["exp_avg"].data.flatten() for s in saved.values()])
    assert set(gathered.unique().tolist()) == {1.0, 2.0}


def moe_forward_backward(model, layout):
    """Logits of this rank's batch (each EP rank its own) and the gradients of their sum."""
    tokens = tokens_BT + layout.ep_rank  # EP ranks route different tokens to each other's experts
    logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), attention_mask=None)
    logits.sum().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def te_general_gemm():
    layout = init_layout(ep=2)
    moe_forward_backward(build_model(moe_arch, layout, moe=MoESettings(token_dispatcher="allgather")), layout)


def alltoall_streams():
    layout = init_layout(ep=2)
    build_model(moe_arch, layout, moe=MoESettings(token_dispatcher="alltoall"))  # creates its stream


def alltoall_split_sizes():
    layout = init_layout(ep=2)
    allgather = build_model(moe_arch, layout, moe=MoESettings(token_dispatcher="allgather"))
    alltoall = build_model(moe_arch, layout, moe=MoESettings(token_dispatcher="alltoall"))
    alltoall.load_state_dict(allgather.state_dict())
    # Both dispatchers compute the same function: the same tokens meet the same experts.
    (logits, grads), (expected_logits, expected_grads) = (moe_forward_backward(module, layout)
                                                          for module in (alltoall, allgather))
    torch.testing.assert_close(logits, expected_logits)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=name)


def torch_norm_sequence_parallel():
    layout = init_layout(tp=2, ep=2, etp=1)  # MoE at TP > 1: sequence parallel
    model = build_model(moe_arch, layout)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    logits = ddp(tokens_BT, torch.arange(tokens_BT.shape[1]).expand_as(tokens_BT), attention_mask=None)
    logits.sum().backward()
    finalize_model_grads([ddp])
    # Each TP rank normed half of the tokens; the finalized gradients of every norm are the sum over both.
    for name, param in model.named_parameters():
        if "norm" in name:
            grads = [torch.zeros_like(param.main_grad) for _ in range(2)]
            dist.all_gather(grads, param.main_grad, group=layout.tp_group)
            assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0, name


def uneven_sequence_parallel():
    # The expert-TP token gather of megatron's alltoall dispatcher (at EP > 1 a different number of tokens
    # from each sequence-parallel rank) and its backward, a reduce-scatter of those parts.
    layout = init_layout(tp=2)
    sizes, rank = [3, 5], layout.tp_rank
    mine = torch.full((sizes[rank], 4), rank + 1.0, requires_grad=True)
    gathered = gather_from_sequence_parallel_region(mine, group=layout.tp_group, output_split_sizes=sizes)
    assert torch.equal(gathered, torch.cat([torch.full((n, 4), r + 1.0) for r, n in enumerate(sizes)]))
    (gathered * torch.arange(8.0)[:, None] * (rank + 1)).sum().backward()
    # Each rank's part of the upstream gradients summed over both ranks (factors 1 + 2).
    expected = (torch.arange(8.0)[:, None] * 3).expand(8, 4)[sum(sizes[:rank]) : sum(sizes[: rank + 1])]
    assert torch.equal(mine.grad, expected)


def faster_collectives():
    # Not a bridge: the distributed optimizer's in-place buffer collectives, as megatron calls them (in a
    # coalescing manager), and megarl's small collectives give what gloo's own give: through shared
    # memory where the ranks share a host (they do here): with vLLM's kernels where its build for this CPU
    # has them (its AVX-512 builds do, its AVX2 build does not), else with megarl's segment, which a
    # group made as if the kernels were missing runs on any x86 CPU; over gloo where the ranks seem apart.
    import socket
    from unittest import mock

    from megarl.distributed import shared_memory

    init_layout()
    kind = shared_memory.VllmKernelGroup if torch.cpu._is_avx512_supported() else shared_memory.SegmentGroup
    assert type(shared_memory.shared_memory_group(dist.group.WORLD)) is kind
    segment = dist.new_group([0, 1])
    with mock.patch.object(shared_memory, "_kernels_present", return_value=False):
        assert type(shared_memory.shared_memory_group(segment)) is shared_memory.SegmentGroup
    apart = dist.new_group([0, 1])
    with mock.patch.object(socket, "gethostname", return_value=f"host{dist.get_rank()}"):
        assert shared_memory.shared_memory_group(apart) is None
    for group in (dist.group.WORLD, segment, apart):
        _buffer_collectives_equal_gloo(group)
        _small_collectives_equal_gloo(group)
    _segment_names_the_rank_that_never_came()


def _segment_names_the_rank_that_never_came():
    # Rank 1 skips a collective that rank 0 enters: rank 0 raises once the timeout has passed.
    import time

    from megarl.distributed import shared_memory

    timeout_s = 0.5
    group = shared_memory.SegmentGroup(dist.new_group([0, 1]), (0, 1), timeout_s)
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            group.all_reduce(torch.ones(4))
        except RuntimeError as error:
            assert "rank(s) [1] did not come within 0.5 s" in str(error), error
            assert timeout_s <= time.monotonic() - start < timeout_s + 1.0
        else:
            raise AssertionError("a collective that rank 1 never entered returned")
    dist.barrier()


def faster_matmuls():
    # Not a bridge: megatron's linear layers (a tied model at TP2: column- and row-parallel, the output
    # layer) multiply through oneDNN where it is the faster kernel, forward and backward (three products
    # a layer), and give what torch's own products give.
    from unittest import mock

    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megarl.kernels import cpu_matmul

    layout = init_layout(tp=2)
    model = build_model(arch, layout)
    tokens = torch.randint(0, arch.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def forward_backward():
        model.zero_grad()
        logits = model(tokens, positions, attention_mask=None)
        (logits.float() ** 2).mean().backward()
        return logits.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}

    with torch.profiler.profile() as profile:
        logits, grads = forward_backward()
    products = sum(event.count for event in profile.key_averages() if event.key == "mkldnn::_linear_pointwise")
    linears = sum(isinstance(module, (ColumnParallelLinear, RowParallelLinear)) for module in model.modules())
    assert products == (3 * linears if cpu_matmul.onednn_faster() else 0), (products, linears)
    with mock.patch.object(cpu_matmul, "onednn_faster", lambda: False):
        expected_logits, expected_grads = forward_backward()
    torch.testing.assert_close(logits, expected_logits)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=name)


def _buffer_collectives_equal_gloo(group):
    from torch.distributed.distributed_c10d import _coalescing_manager

    buffers = sys.modules["megatron.core.distributed.param_and_grad_buffer"]
    rank, half = dist.get_rank(), 300_000  # 1.2 MB a rank: over a segment's slot, so in two rounds
    for seed in range(3):
        grads = torch.randn(2 * half, generator=torch.Generator().manual_seed(10 * seed + rank))
        expected = torch.empty(half)
        dist.reduce_scatter_tensor(expected, grads.clone(), group=group)
        with _coalescing_manager(group):
            buffers.dist_reduce_scatter_func(grads[rank * half: (rank + 1) * half], grads, group=group)
        assert torch.equal(grads[rank * half: (rank + 1) * half], expected)
        params = torch.randn(2 * half, generator=torch.Generator().manual_seed(10 * seed + rank))
        expected = torch.empty(2 * half)
        dist.all_gather_into_tensor(expected, params[rank * half: (rank + 1) * half].clone(), group=group)
        with _coalescing_manager(group):
            buffers.dist_all_gather_func(params, params[rank * half: (rank + 1) * half], group=group)
        assert torch.equal(params, expected)


def _small_collectives_equal_gloo(group):
    from megarl.distributed import collectives

    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    payload = torch.tensor([float("nan")]).view(torch.int32) | (rank + 1)  # a NaN whose payload names the rank
    cases = [(torch.randn(5, 3, generator=generator), dist.ReduceOp.SUM),  # the shared-memory kernel's sum
             (torch.randn(3, 5, generator=generator).t(), dist.ReduceOp.SUM),  # not contiguous
             (torch.randn(7, generator=generator, dtype=torch.float64), dist.ReduceOp.SUM),
             (torch.randint(-9, 9, (6,), generator=generator), dist.ReduceOp.MAX),
             (torch.randn(2, generator=generator, dtype=torch.float64), dist.ReduceOp.MIN),
             (torch.cat([payload.view(torch.float32), torch.randn(2, generator=generator)]), dist.ReduceOp.MAX)]
    for tensor, op in cases:
        expected = tensor.clone()
        dist.all_reduce(expected, op=op, group=group)
        collectives.all_reduce(tensor, op=op, group=group)
        assert torch.equal(tensor.nan_to_num(), expected.nan_to_num()), (tensor, expected)
        expected = [torch.empty_like(tensor) for _ in range(2)]
        dist.all_gather(expected, tensor, group=group)
        gathered = collectives.all_gather(tensor, group=group)
        as_bytes = [[t.contiguous().view(torch.uint8).tolist() for t in parts] for parts in (gathered, expected)]
        assert as_bytes[0] == as_bytes[1]
    # An all-to-all whose parts differ in size by sender and receiver, one of them empty.
    sizes = [[0, 3], [5, 2]]  # sizes[sender][receiver]
    sent = torch.randn(sum(sizes[rank]), generator=generator, dtype=torch.float64)
    expected = torch.empty(sizes[0][rank] + sizes[1][rank], dtype=torch.float64)
    dist.all_to_all_single(expected, sent, [sizes[0][rank], sizes[1][rank]], sizes[rank], group=group)
    received = torch.empty_like(expected)
    collectives.all_to_all(received, sent, [sizes[0][rank], sizes[1][rank]], sizes[rank], group=group)
    assert torch.equal(received, expected)
    mine = {"rank": rank, "text": "x" * (100 * rank + 3)}  # sizes differ by rank
    expected = [None, None]
    dist.all_gather_object(expected, mine, group=group)
    assert collectives.all_gather_object(mine, group=group) == expected


SCENARIOS = {f.__name__: f for f in (rng_tracker, current_device, cuda_factories, synchronize, tensor_cuda,
                                     clip_grads_type, optimizer_type, optimizer_gather_cuda, te_general_gemm,
                                     alltoall_streams, alltoall_split_sizes, torch_norm_sequence_parallel,
                                     uneven_sequence_parallel)}
assert set(SCENARIOS) == {bridge.name for bridge in cpu_compat.BRIDGES}
SPEED_UPS = {f.__name__: f for f in (faster_matmuls, faster_collectives)}  # not bridges: run with all of them

failed = False
for name, scenario in (SCENARIOS | SPEED_UPS).items():
    if args.skip and name != args.skip:
        continue
    try:
        scenario()
        if os.environ["RANK"] == "0":
            write_line(f"PASS {name}")
    except Exception as error:  # report, then fail the launch
        message = str(error).splitlines()[0] if str(error) else ""
        failing_line = traceback.extract_tb(error.__traceback__)[-1].line
        write_line(f"ERROR {name}: {type(error).__name__}: {message} (at: {failing_line})")
        traceback.print_exc(file=sys.stderr)
        failed = True
if dist.is_initialized() and not failed:
    dist.destroy_process_group()
# A failed rank may leave its peer blocked in a collective: exit hard.
sys.stdout.flush()
os._exit(3 if failed else 0)
