"""Bridges megatron-core's CUDA assumptions so that it runs on CPU over gloo.

megatron-core 0.16 assumes a GPU (or Transformer Engine, or Apex) in thirteen places; each is bridged by one
named `Bridge` in `BRIDGES` (its `_apply_*` function says what it bridges), so a test can leave one out and
watch the megatron code path it guards fail. All are applied when `megarl.device` says CUDA is absent. On
CUDA only the two that stand in for what Transformer Engine or Apex would provide (`te_general_gemm`,
`torch_norm_sequence_parallel`: `Bridge.on_cuda`) are: megatron's local layers need them there too, with
`model.layer_spec=local` or when TE does not import.

Besides the bridges, two functions make changes for speed on CPU, which megatron on GPU would not need.
`faster_matmuls`: megatron's linear layers multiply through `megarl.kernels.cpu_matmul` (oneDNN on the
CPUs where torch's float32 product runs at half speed), the forward's `torch.matmul` through the view
and the backward's `Tensor.matmul` for the duration of the backward. `faster_collectives`:
- megatron's blocking all-reduces (the grad norm, the TP all-reduces of activations) go through
  `megarl.distributed.collectives`: shared memory where the group's ranks share a host, since small
  tensors over gloo cost its latency.
- the distributed optimizer reduce-scatters its gradient buffers and all-gathers its parameter buffers
  in place, each rank's shard a slice of the whole buffer; gloo runs both slower than the collectives
  that do the same, and over one rank (DP1), where they change nothing, copies the whole buffer through
  a scratch one. So: over one rank they return at once; the reduce-scatter all-reduces the buffer
  through `collectives`; the all-gather gathers in place through shared memory on one host and, across
  hosts, broadcasts each rank's shard from that rank.

How: megatron modules get a *view* of `torch` as their module global `torch`; the view forwards
everything to the real module, except the attributes a bridge sets on it. Nothing outside
megatron (vLLM, transformers, our own code) sees a changed `torch`. The bridges of Tensor methods
(`tensor_cuda`, `clip_grads_type`, `optimizer_type`, `optimizer_gather_cuda`) cannot be scoped by module,
so they wrap the one megatron function that needs them and patch the Tensor method only for the
duration of that call.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from megarl import device
from megarl.distributed import collectives
from megarl.distributed.shared_memory import SUPPORTED_DTYPES, shared_memory_group
from megarl.kernels import cpu_matmul

# Entry points whose imports pull in every megatron module that assumes CUDA; after importing
# them, each loaded `megatron.core` module gets the view as its `torch` global.
_MEGATRON_ENTRY_POINTS = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)


class _ForwardingView(types.ModuleType):
    """A module object that answers with its own attributes first, then with `target`'s."""

    def __init__(self, name: str, target: object):
        super().__init__(name)
        self._target = target

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def _torch_view() -> _ForwardingView:
    view = _ForwardingView("torch", torch)
    view.cuda = _ForwardingView("torch.cuda", torch.cuda)
    view.distributed = _ForwardingView("torch.distributed", torch.distributed)
    return view


@dataclass(frozen=True)
class Bridge:
    name: str
    assumption: str
    apply: Callable[[_ForwardingView | None], None]
    symptom: str = "cuda"
    """What the error of the megatron path reads like without the bridge (lower case)."""
    on_cuda: bool = False
    """Applied on CUDA too: it stands in for a Transformer Engine or Apex module, not for CUDA. Such a
    bridge patches megatron's modules itself and is given no view of torch (None)."""


def _on_cpu(device):
    return "cpu" if device is not None and torch.device(device).type == "cuda" else device


def _cpu_factory(factory):
    @functools.wraps(factory)
    def make(*args, device=None, **kwargs):
        return factory(*args, device=_on_cpu(device), **kwargs)

    return make


def _tensor_cuda_is_identity():
    return _patched(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


@contextlib.contextmanager
def _patched(owner, name: str, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _wrap_with(owner, name: str, context: Callable[[], contextlib.AbstractContextManager]):
    """Replace `owner.name` (a function or method) by one that runs the original inside `context()`."""
    raw = inspect.getattr_static(owner, name)
    descriptor = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    original = raw.__func__ if descriptor else raw
    if getattr(original, "_megarl_bridged", False):
        return

    @functools.wraps(original)
    def bridged(*args, **kwargs):
        with context():
            return original(*args, **kwargs)

    bridged._megarl_bridged = True
    setattr(owner, name, descriptor(bridged) if descriptor else bridged)


def _cuda_type_names():
    """Make `Tensor.type()` of CPU tensors read like CUDA type names, e.g. torch.cuda.FloatTensor."""
    real_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and self.device.type == "cpu":
            return real_type(self).replace("torch.", "torch.cuda.", 1)
        return real_type(self, dtype, non_blocking, **kwargs)

    return _patched(torch.Tensor, "type", type_)


def _apply_current_device(view):
    """`torch.cuda.current_device()` used as the device of buffers (the global memory buffer of local
    attention, DDP buffers, pipeline p2p shape tensors)."""
    view.cuda.current_device = lambda: "cpu"


def _apply_rng_tracker(view):
    """The tensor-parallel RNG tracker reads and writes the CUDA generator."""
    # The CPU default generator plays the role of the device generator: the tracker swaps its
    # state in and out exactly as it would swap the CUDA generator's.
    random = sys.modules["megatron.core.tensor_parallel.random"]
    view.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    view.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )


def _apply_synchronize(view):
    """`torch.cuda.synchronize()` after pipeline p2p communication and before dist_checkpointing's writers
    copy tensors."""
    view.cuda.synchronize = lambda device=None: None


def _apply_tensor_cuda(view):
    """`Tensor.cuda()` when tied embeddings are synchronised across pipeline stages."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _wrap_with(LanguageModule, "setup_embeddings_and_output_layer", _tensor_cuda_is_identity)


def _apply_cuda_factories(view):
    """`device="cuda"` tensor factories in the schedules, optimizer, grad clipping and the grad-norm
    helper."""
    for name in ("zeros", "ones", "empty", "full", "tensor", "arange"):
        setattr(view, name, _cpu_factory(getattr(torch, name)))


def _apply_clip_grads_type(view):
    """Grad clipping asserts `grad.type() == "torch.cuda.FloatTensor"`."""
    clip_grads = sys.modules["megatron.core.optimizer.clip_grads"]
    _wrap_with(clip_grads, "clip_grad_by_total_norm_fp32", _cuda_type_names)
    # `optimizer.py` imported the function by name: rebind it there too.
    sys.modules["megatron.core.optimizer.optimizer"].clip_grad_by_total_norm_fp32 = (
        clip_grads.clip_grad_by_total_norm_fp32
    )


def _apply_optimizer_type(view):
    """The optimizers sort parameters by CUDA type names."""
    optimizer = sys.modules["megatron.core.optimizer.optimizer"]
    distrib_optimizer = sys.modules["megatron.core.optimizer.distrib_optimizer"]
    _wrap_with(optimizer.Float16OptimizerWithFloat16Params, "__init__", _cuda_type_names)
    _wrap_with(
        distrib_optimizer.DistributedOptimizer,
        "_build_model_and_main_param_groups",
        _cuda_type_names,
    )


def _apply_optimizer_gather_cuda(view):
    """Saving the distributed optimizer's state in its layout-independent (`fully_reshardable`) form
    all-gathers it over DP after `Tensor.cuda()`."""
    distrib_optimizer = sys.modules["megatron.core.optimizer.distrib_optimizer"]
    _wrap_with(distrib_optimizer.DistributedOptimizer, "get_parameter_state_dp_zero", _tensor_cuda_is_identity)


def _apply_te_general_gemm(view):
    """The MoE router's gating GEMM tests `te_general_gemm is not None`, a name that `moe_utils` defines only
    when Transformer Engine imports (on CUDA too)."""
    moe_utils = sys.modules["megatron.core.transformer.moe.moe_utils"]
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # what the module means when TE is absent


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """`moe_utils.maybe_move_tensor_to_cpu` for tensors that already live on the host: what its
    device-to-host copy returns (a copy, as a numpy array if asked)."""
    if not torch.is_tensor(tensor):
        return tensor
    return tensor.numpy().copy() if as_numpy else tensor.clone()


class _HostEvent:
    def synchronize(self) -> None:
        pass  # host work is done when it returns


class _HostStream:
    """Stands in for a CUDA stream: host work runs in program order, so waiting is a no-op."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self) -> _HostEvent:
        return _HostEvent()


def _apply_alltoall_streams(view):
    """The alltoall token dispatcher copies its token counts to the host on a side `torch.cuda.Stream` and
    waits on an event recorded there; on CPU the counts already live on the host, and the stream and event do
    nothing."""
    host_stream = _HostStream()
    view.cuda.Stream = lambda *args, **kwargs: _HostStream()
    view.cuda.current_stream = lambda device=None: host_stream
    view.cuda.stream = lambda stream: contextlib.nullcontext()


def _apply_alltoall_split_sizes(view):
    """The alltoall dispatcher's device-to-host copy (`maybe_move_tensor_to_cpu`) is what turns the split
    sizes into the numpy arrays `all_to_all_single` takes; it skips host tensors, whose split sizes would
    reach gloo as tensors, which it rejects. On CPU the "copy" still makes the numpy arrays."""
    sys.modules["megatron.core.transformer.moe.token_dispatcher"].maybe_move_tensor_to_cpu = _host_copy


def _apply_torch_norm_sequence_parallel(view):
    """Sequence parallelism (which megatron needs to train MoE layers at TP > 1) splits the norms' inputs over
    the TP ranks, so each rank's norm-weight gradient is a partial sum that `finalize_model_grads` all-reduces
    for weights marked `sequence_parallel`. Apex's and TE's norms mark them; megatron's torch-norm fallback
    (the local spec's RMSNorm, Apex or not) asserts sequence parallelism away instead. The bridge builds the
    same torch norm and marks its weights."""
    torch_norm = sys.modules["megatron.core.transformer.torch_norm"].WrappedTorchNorm
    build = torch_norm.__new__
    if getattr(build, "_megarl_bridged", False):
        return

    def build_marked(cls, config, *args, **kwargs):
        unsplit = copy.copy(config)  # the fallback's own checks see no sequence parallelism
        unsplit.sequence_parallel = False
        norm = build(cls, unsplit, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    build_marked._megarl_bridged = True
    torch_norm.__new__ = staticmethod(build_marked)


def _all_gather_unequal(tensor_list, tensor, group=None, async_op=False):
    """`torch.distributed.all_gather` that also takes parts of unequal lengths along dim 0."""
    longest = max(part.shape[0] for part in tensor_list)
    if all(part.shape[0] == longest for part in tensor_list):
        return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    padded = [tensor.new_empty((longest, *tensor.shape[1:])) for _ in tensor_list]
    mine = torch.cat([tensor, tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))])
    torch.distributed.all_gather(padded, mine, group=group)
    for part, gathered in zip(tensor_list, padded):
        part.copy_(gathered[: part.shape[0]])


def _reduce_scatter_list(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
    """`torch.distributed.reduce_scatter` (absent in gloo): all-reduce everything, keep this rank's part."""
    reduced = torch.cat([part.reshape(-1) for part in input_list])
    torch.distributed.all_reduce(reduced, op=op, group=group)
    start = sum(part.numel() for part in input_list[: torch.distributed.get_rank(group)])
    output.copy_(reduced[start : start + output.numel()].view_as(output))


def _apply_uneven_sequence_parallel(view):
    """With sequence parallelism, experts split over expert-TP ranks gather the tokens routed to them from the
    sequence-parallel ranks, a different number from each (`all_gather` into unequal parts), and
    reduce-scatter their gradients back the same way (`reduce_scatter` of a list). gloo takes equal parts only
    and has no list reduce-scatter: in megatron's TP mappings, unequal parts are padded to the largest for the
    gather, and the reduce-scatter is an all-reduce of which each rank keeps its part."""
    mappings = sys.modules["megatron.core.tensor_parallel.mappings"]
    mappings.torch = _ForwardingView("torch", view)  # scoped to the TP mappings
    mappings.torch.distributed = _ForwardingView("torch.distributed", view.distributed)
    mappings.torch.distributed.all_gather = _all_gather_unequal
    mappings.torch.distributed.reduce_scatter = _reduce_scatter_list


BRIDGES = (
    Bridge("current_device", "torch.cuda.current_device() as a buffer device", _apply_current_device),
    Bridge("rng_tracker", "tensor-parallel RNG tracker on the CUDA generator", _apply_rng_tracker),
    Bridge("synchronize", "torch.cuda.synchronize() after p2p", _apply_synchronize),
    Bridge("tensor_cuda", "Tensor.cuda() for tied embeddings across stages", _apply_tensor_cuda),
    Bridge("cuda_factories", 'device="cuda" tensor factories', _apply_cuda_factories),
    Bridge("clip_grads_type", "grad clipping asserts CUDA grad types", _apply_clip_grads_type),
    Bridge("optimizer_type", "optimizers sort params by CUDA type names", _apply_optimizer_type),
    Bridge("optimizer_gather_cuda", "Tensor.cuda() before gathering optimizer state to save it",
           _apply_optimizer_gather_cuda),
    Bridge("te_general_gemm", "MoE router gating reads te_general_gemm, undefined without TE", _apply_te_general_gemm,
           symptom="te_general_gemm", on_cuda=True),
    Bridge("alltoall_streams", "alltoall token dispatcher copies counts to the host on a CUDA stream",
           _apply_alltoall_streams),
    Bridge("alltoall_split_sizes", "alltoall split sizes become numpy arrays only by a device-to-host copy",
           _apply_alltoall_split_sizes, symptom="all_to_all_single"),
    Bridge("torch_norm_sequence_parallel", "sequence-parallel norms need Apex or TE to mark their weights",
           _apply_torch_norm_sequence_parallel, symptom="sequence parallel", on_cuda=True),
    Bridge("uneven_sequence_parallel", "expert-TP token gathers and gradient scatters of unequal parts over gloo",
           _apply_uneven_sequence_parallel, symptom="invalid tensor size"),
)


def _is_shard_of(part: torch.Tensor, buffer: torch.Tensor, group) -> bool:
    """`part` is this rank's slice of `buffer`, split in equal parts over `group` (megatron's shards)."""
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    offset = (part.data_ptr() - buffer.data_ptr()) // buffer.element_size()
    return buffer.numel() == size * part.numel() and offset == rank * part.numel()


def _reduce_scatter_in_place(reduce_scatter):
    @functools.wraps(reduce_scatter)
    def faster(output, input, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if not _is_shard_of(output, input, group):
            return reduce_scatter(output, input, op=op, group=group, async_op=async_op)
        collectives.all_reduce(input, op=op, group=group)
        return None  # megatron keeps no handle of these calls

    return faster


def _all_gather_in_place(all_gather):
    @functools.wraps(all_gather)
    def faster(output, input, group=None, async_op=False):
        if async_op or not _is_shard_of(input, output, group):
            return all_gather(output, input, group=group, async_op=async_op)
        if torch.distributed.get_world_size(group) == 1:
            return None
        shared = shared_memory_group(group)
        if shared is not None and input.dtype in SUPPORTED_DTYPES:
            shared.all_gather(output, input)
            return None
        for index, shard in enumerate(output.chunk(torch.distributed.get_world_size(group))):
            source = index if group is None else torch.distributed.get_global_rank(group, index)
            torch.distributed.broadcast(shard, source, group=group)
        return None

    return faster


def _blocking_all_reduce_on_host(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
    if async_op:
        return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=True)
    collectives.all_reduce(tensor, op=op, group=group)
    return None


def faster_collectives(view) -> None:
    """megatron's blocking all-reduces and the distributed optimizer's in-place buffer collectives,
    as they run fastest on CPU (module docstring)."""
    view.distributed.all_reduce = _blocking_all_reduce_on_host
    buffers = sys.modules["megatron.core.distributed.param_and_grad_buffer"]
    buffers.dist_reduce_scatter_func = _reduce_scatter_in_place(buffers.dist_reduce_scatter_func)
    buffers.dist_all_gather_func = _all_gather_in_place(buffers.dist_all_gather_func)


def faster_matmuls(view) -> None:
    """megatron's linear layers' products through `cpu_matmul` (module docstring)."""
    view.matmul = cpu_matmul.matmul
    layers = sys.modules["megatron.core.tensor_parallel.layers"]
    for function in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        _wrap_with(function, "backward", lambda: _patched(torch.Tensor, "matmul", cpu_matmul.matmul))


def needed_bridges() -> list[Bridge]:
    """The bridges this process needs: all of them without CUDA; on CUDA those standing in for
    Transformer Engine or Apex modules (`Bridge.on_cuda`)."""
    return [bridge for bridge in BRIDGES if bridge.on_cuda or not device.cuda()]


def apply_cpu_compat(skip: Iterable[str] = ()) -> None:
    """Apply the bridges this process needs (`needed_bridges`), except those named in `skip` (for tests).

    Does nothing when already applied in this process (the first call decides the set of bridges).
    Call before building models.
    """
    skip = set(skip)
    unknown = skip - {bridge.name for bridge in BRIDGES}
    if unknown:
        raise ValueError(f"unknown CPU bridges {sorted(unknown)}; known: {[b.name for b in BRIDGES]}")
    for module_name in _MEGATRON_ENTRY_POINTS:
        importlib.import_module(module_name)
    bridges = [bridge for bridge in needed_bridges() if bridge.name not in skip]
    if device.cuda():
        for bridge in bridges:
            bridge.apply(None)  # each is idempotent
        return
    if isinstance(sys.modules["megatron.core.utils"].torch, _ForwardingView):
        return
    view = _torch_view()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = view
    for bridge in bridges:
        bridge.apply(view)
    faster_matmuls(view)
    faster_collectives(view)
