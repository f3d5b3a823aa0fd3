"""The training engine at TP1, TP2, PP2, TP2xPP2 and DP2 (4 processes at most).

At every layout: log-probs and entropy (temperature 0.7) and critic values equal `transformers`
(<= 1e-4), and one AdamW step of a fixed loss (with grad clipping) gives the same weights as at TP1
(<= 1e-5). PP2 and DP2 use token-budget micro-batches and TP2 recomputes activations; neither may
change the update. TP2xPP2 builds its engines for prompt groups, so they run each prompt once for the
sequences that share it (`share_prompt_forward`; the batch holds two prompts sampled twice): the same
outputs and step, their attention layers applying the masks each forward gives them; the other layouts'
engines, built without groups, do not share, and their attention masks causally on its own.
DP2 reduces gradients in buckets while backward runs (`overlap_grad_reduce`), also at a step with fewer
token-budget micro-batches than the steps before it, and trains a bf16 copy of the policy for a few steps beside
the fp32 one.

A tiny Qwen3-MoE is trained at EP1, EP2 and TP2xEP2 in one 2-process world (`moe_engine_checks.py`), built for
prompt groups as an RL run builds it (it does not share them): its step, router losses included, equals
`transformers` and EP1, its routing metrics equal a count of HF's
routing, and an EP2 checkpoint resumes exactly (also at EP1, as an EP1 one at EP2). An MoE critic scores and
trains at TP2xEP2.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, assert_succeeded, reported, torchrun

SCRIPT = ROOT / "tests/distributed/scripts/engine_checks.py"
LAYOUTS = {"tp2": (2, ["--tp", 2, "--recompute"]), "pp2": (2, ["--pp", 2, "--dynamic"]),
           "tp2pp2": (4, ["--tp", 2, "--pp", 2, "--share-prompts", "--dynamic"]),
           "dp2": (2, ["--dynamic", "--bf16-steps", 3, "--grad-bucket-size", 20000])}


def _run(tiny_models, out, nproc, extra):
    result = torchrun(nproc, SCRIPT, "--policy", tiny_models["qwen3-untied"], "--value", tiny_models["qwen2-value"],
                      "--out", out, *extra)
    assert_succeeded(result)
    return reported(result)


def _weights(model_dir):
    tensors = {}
    for file in model_dir.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def baseline(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "tp1"
    return _run(tiny_models, out, 1, []), _weights(out)


def test_tp1_scores_match_transformers_and_the_step_moves_weights(baseline, tiny_models):
    report, weights = baseline
    assert report["logprob_entropy_diff"] <= 1e-4 and report["value_diff"] <= 1e-4
    assert report["kept_outputs_vs_score"] <= 1e-5
    assert report["dense_router_replay_error"].startswith("actor.router_replay=true needs a mixture-of-experts")
    source = _weights(tiny_models["qwen3-untied"])
    moved = max(float((weights[name] - source[name]).abs().max()) for name in source)
    assert 5e-4 < moved < 2e-3  # an AdamW step of lr 1e-3 moves weights by about lr
    assert report["grad_norm"] > 1.0 and report["update_skipped"] == 0.0  # clipping was active
    # Offload frees the device storage of fp32 params and grads and Adam's two moments (and steps).
    padding_rows = 2 * (128 - 101)  # untied embedding and output layer, vocab 101 padded to 128
    params = sum(t.numel() for t in source.values()) + padding_rows * 128
    assert report["param_count"] == params
    moved = report["offload_bytes"]
    # The distributed optimizer's buffers align each parameter to 64 elements and the bucket end to
    # 128 (megatron's param_and_grad_buffer); megatron fuses HF tensors, so it has at most len(source).
    alignment = 64 * len(source) + 128
    assert 4 * params <= moved["params"] == moved["grads"] <= 4 * (params + alignment)
    assert moved["optimizer"] >= 8 * params


@pytest.fixture(scope="module")
def layout_run(tiny_models, tmp_path_factory):
    """(report, exported weights) of a layout's launch, launched once per module."""
    runs = {}

    def run(layout):
        if layout not in runs:
            out = tmp_path_factory.mktemp(layout)
            nproc, extra = LAYOUTS[layout]
            runs[layout] = _run(tiny_models, out, nproc, extra), _weights(out)
        return runs[layout]

    return run


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_transformers_and_tp1_step(baseline, layout_run, layout):
    base_report, base_weights = baseline
    report, weights = layout_run(layout)
    shares = layout == "tp2pp2"
    assert report["shares_prompts"] == [shares] * 2
    assert report["attention_masks"] == [["arbitrary" if shares else "causal"]] * 2
    # Token-budget micro-batches keep a prompt's responses in one row: 6 distinct prompts of 8 sequences.
    assert report["rows_scored"] == (6 if shares else report["sequences"])
    assert report["logprob_entropy_diff"] <= 1e-4 and report["value_diff"] <= 1e-4
    assert report["kept_outputs_vs_score"] <= 1e-5
    assert report["loss"] == pytest.approx(base_report["loss"], abs=1e-5)
    assert report["grad_norm"] == pytest.approx(base_report["grad_norm"], rel=1e-5)
    for name, tensor in base_weights.items():
        assert torch.allclose(weights[name], tensor, atol=1e-5, rtol=0), f"{layout}: {name}"


def test_dp2_reduces_gradients_in_several_overlapped_buckets(layout_run):
    report, _ = layout_run("dp2")
    assert report["grad_buckets"] > 1  # its weights equal TP1's: test_layout_matches_transformers_and_tp1_step
    # A later step with fewer token-budget micro-batches still reduces (megatron's schedule runs all but the
    # last under DDP's no_sync; without it that step stopped: "Communication call has not been issued").
    many, fewer = report["micro_batches"]
    assert many > fewer >= 1 and report["fewer_micro_batches_loss"] > 0


def test_bf16_accumulates_gradients_in_fp32_and_tracks_fp32_losses(layout_run):
    report, _ = layout_run("dp2")
    assert "torch.bfloat16" in report["bf16_param_dtypes"]
    # grad_reduce_in_fp32: micro-batch accumulation and the DP reduction happen in fp32 buffers.
    assert report["bf16_grad_buffer_dtypes"] == ["torch.float32"]
    fp32, bf16 = report["fp32_losses"], report["bf16_losses"]
    assert len(bf16) == 3 and bf16[-1] < bf16[0] - 1.0  # it trains
    # bf16 rounds weights and activations at 2**-8 (~4e-3 relative); a loss averaged over ~100 tokens
    # lands within ~1e-3 of fp32 (seen: <= 2e-3 after three steps); 1e-2 allows the steps to drift.
    assert bf16 == pytest.approx(fp32, rel=1e-2)


# ---- mixture of experts: EP2 against EP1 and `transformers`, resume, router losses and expert load ----

MOE_SCRIPT = ROOT / "tests/distributed/scripts/moe_engine_checks.py"


@pytest.fixture(scope="module")
def moe_run(tiny_moe_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    result = torchrun(2, MOE_SCRIPT, "--policy", tiny_moe_models["qwen3-moe"],
                      "--value", tiny_moe_models["qwen2-moe-value"], "--sigmoid-policy", tiny_moe_models["deepseek-v3"],
                      "--out", out)
    assert_succeeded(result)
    return reported(result), out


def _per_layer(metrics, name, num_layers):
    return [metrics[f"moe/layer{layer}/{name}"] for layer in range(num_layers)]


def test_moe_step_at_ep2_equals_ep1_and_transformers_with_router_losses_in_the_backward_only(moe_run):
    report, out = moe_run
    reference = report["reference"]
    for ep in ("ep1", "ep2"):
        step = report[ep]
        assert step["score_diff"] <= 1e-4 and step["uneven_score_diff"] <= 1e-4
        # The reported loss is the policy loss alone; the gradient also holds the router losses.
        assert step["loss"] == pytest.approx(reference["loss"], abs=1e-5)
        assert step["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
        assert step["grad_norm"] > 1.0 and step["update_skipped"] == 0.0  # clipped
    assert report["ep2"]["loss"] == pytest.approx(report["ep1"]["loss"], abs=1e-6)
    assert report["ep2"]["grad_norm"] == pytest.approx(report["ep1"]["grad_norm"], rel=1e-5)
    # A DP rank sitting a step out adds nothing, its router losses included, at either EP.
    idle1, idle2 = report["ep1"]["idle_step"], report["ep2"]["idle_step"]
    assert idle2["loss"] == pytest.approx(idle1["loss"], abs=1e-6)
    assert idle2["grad_norm"] == pytest.approx(idle1["grad_norm"], rel=1e-5)
    ep1, ep2 = _weights(out / "ep1"), _weights(out / "ep2")
    assert ep1.keys() == ep2.keys() and any(".experts." in name for name in ep1)
    for name, tensor in ep1.items():
        assert torch.allclose(ep2[name], tensor, atol=1e-5, rtol=0), name


def test_moe_policy_built_for_prompt_groups_does_not_share_them(moe_run):
    """Sharing is on by default and the groups repeat every prompt 8 times, but megatron's MoE layers
    take no shared rows: off, and the step above is that of one row per sequence."""
    report, _ = moe_run
    assert not report["ep1"]["shares_prompts"] and not report["ep2"]["shares_prompts"]


def test_moe_trains_at_tp2xep2_with_sequence_parallelism_as_at_ep1(moe_run):
    report, out = moe_run
    reference, step = report["reference"], report["tp2ep2"]
    assert step["score_diff"] <= 1e-4
    assert step["loss"] == pytest.approx(reference["loss"], abs=1e-5)
    assert step["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)  # router losses at full weight
    ep1, tp2ep2 = _weights(out / "ep1"), _weights(out / "tp2ep2")
    assert ep1.keys() == tp2ep2.keys()
    for name, tensor in ep1.items():
        assert torch.allclose(tp2ep2[name], tensor, atol=1e-5, rtol=0), name
    tokens_LE = torch.tensor(reference["tokens_LE"])  # each TP rank routes its part of the sequence: summed
    assert _per_layer(step, "tokens_per_expert_max", len(tokens_LE)) == tokens_LE.max(1).values.tolist()
    assert _per_layer(step, "load_balancing_loss", len(tokens_LE)) == pytest.approx(reference["load_balancing_loss"],
                                                                                   rel=1e-5)
    # The z-loss metric is the mean of the TP ranks' token means; their halves of a padded micro-batch
    # hold unequal numbers of real tokens (seen: up to 0.9% from the token mean in a layer).
    assert _per_layer(step, "z_loss", len(tokens_LE)) == pytest.approx(reference["z_loss"], rel=2e-2)
    # An MoE critic (value head behind the sequence-parallel gather) scores and trains as `transformers`.
    assert report["critic_value_diff"] <= 1e-4
    assert report["critic_step"]["grad_norm"] == pytest.approx(report["critic_reference_grad_norm"], rel=1e-4)


def test_moe_router_loss_and_expert_load_metrics_match_transformers_routing(moe_run):
    report, _ = moe_run
    reference = report["reference"]
    tokens_LE = torch.tensor(reference["tokens_LE"])
    num_layers = len(tokens_LE)
    for ep in ("ep1", "ep2"):
        step = report[ep]
        assert _per_layer(step, "tokens_per_expert_max", num_layers) == tokens_LE.max(1).values.tolist()
        assert _per_layer(step, "tokens_per_expert_mean", num_layers) == pytest.approx(tokens_LE.mean(1).tolist())
        for name in ("load_balancing_loss", "z_loss"):
            assert _per_layer(step, name, num_layers) == pytest.approx(reference[name], rel=1e-5)
            assert step[f"moe/{name}"] == pytest.approx(sum(reference[name]) / num_layers, rel=1e-5)
        ratio = (tokens_LE.max(1).values / tokens_LE.mean(1)).max()
        assert step["moe/load_max_over_mean"] == pytest.approx(float(ratio)) and ratio > 1


def test_moe_resumes_exactly_at_ep2_and_across_ep_sizes(moe_run):
    report, _ = moe_run
    step3, resumed = report["step3"], report["step3_resumed_ep2"]
    assert resumed["loss"] == step3["loss"] and resumed["grad_norm"] == step3["grad_norm"]
    assert report["weights_diff_resumed_ep2"] == 0.0
    assert step3["loss"] < report["ep2"]["loss"]  # step 3 starts from the trained weights
    # EP1 -> EP2 and EP2 -> EP1: step 4 follows from the restored Adam moments and step count.
    for resumed_steps in (report["resumed_from_ep1"], report["resumed_at_ep1"]):
        for step, expected in zip(resumed_steps, (step3, report["step4"])):
            assert step["loss"] == pytest.approx(expected["loss"], rel=1e-6)
            assert step["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)


def test_aux_loss_free_expert_bias_moves_towards_equal_load(moe_run):
    report, _ = moe_run
    tokens_LE = torch.tensor(report["reference"]["sigmoid_tokens_LE"])
    # megatron's update: bias += rate * sign(mean load - expert load), from the step's global counts
    offset_LE = tokens_LE.mean(1, keepdim=True) - tokens_LE
    expected, bias = 1e-3 * torch.sign(offset_LE), torch.tensor(report["expert_bias_LE"])
    # A near-tie routed differently by float32 rounding moves a count by one token (seen once in 32 experts).
    decided = offset_LE.abs() >= 2
    assert decided.float().mean() > 0.5 and torch.equal(bias[decided], expected[decided])
    assert set(bias.unique().tolist()) <= set(expected.unique().tolist())


def test_router_replay_routes_every_recorded_token_as_the_rollout_did(moe_run):
    report, _ = moe_run
    own, replayed = report["own_routing"], report["replayed"]
    replayed_pp2, replayed_tp2ep2 = report["replayed_pp2"], report["replayed_tp2ep2"]
    recorded = 4 * sum(n - 1 for n in (15, 15, 14, 19, 7, 11, 11, 16))  # 4 layers x (length - 1) per sequence
    for run in (own, replayed, replayed_pp2, replayed_tp2ep2):
        assert run["recorded"] == recorded
    # Perturbed routers route part of the tokens elsewhere on their own; the metric counts what the hook saw.
    assert 0 < own["differing"] < recorded / 2
    assert own["moe/routing_agreement"] == pytest.approx(1 - own["differing"] / recorded, abs=1e-12)
    # With replay every recorded (token, layer) goes to the rollout's experts, at EP2, at PP2 with
    # recomputation and at TP2xEP2 (sequence parallel: each TP rank routes its slice of the positions).
    # The metric still measures the routers' own choice, which differs from the one without replay from
    # the second layer on: their inputs came through other experts.
    assert replayed["differing"] == replayed_pp2["differing"] == replayed_tp2ep2["differing"] == 0
    assert 0 < replayed["moe/routing_agreement"] < 1
    assert replayed["loss"] != own["loss"]
    for other in (replayed_pp2, replayed_tp2ep2):
        assert other["moe/routing_agreement"] == pytest.approx(replayed["moe/routing_agreement"], abs=1e-12)
        assert other["loss"] == pytest.approx(replayed["loss"], abs=1e-5)  # seen 1e-6 apart: sums in another order
        assert other["grad_norm"] == pytest.approx(replayed["grad_norm"], rel=1e-5)


def test_sigmoid_router_replays_the_rollout_and_balances_from_the_checkpoints_bias(moe_run):
    report, _ = moe_run
    own, replayed = report["sigmoid_own_routing"], report["sigmoid_replayed"]
    # DeepSeek-V3: 3 MoE layers after the dense first one; routing by sigmoid scores, bias and groups.
    recorded = 3 * sum(n - 1 for n in (15, 15, 14, 19, 7, 11, 11, 16))
    assert own["recorded"] == replayed["recorded"] == recorded
    assert 0 < own["differing"] < recorded / 2 and replayed["differing"] == 0
    assert own["moe/routing_agreement"] == pytest.approx(1 - own["differing"] / recorded, abs=1e-12)
    # The checkpoint's correction bias is loaded (non-zero) and stays without aux-loss-free balancing; with it,
    # each expert's bias moves by the update rate (or not at all, for an expert at exactly the mean load).
    fixed, balanced = report["sigmoid_bias_fixed"], report["sigmoid_bias_balanced"]
    # Scores and the step (without router losses) as transformers computes them, through the checkpoint's bias.
    reference_loss, reference_grad_norm = report["sigmoid_reference"]
    assert report["sigmoid_score_diff"] <= 1e-4
    assert fixed["loss"] == pytest.approx(reference_loss, abs=1e-5)
    assert fixed["grad_norm"] == pytest.approx(reference_grad_norm, rel=1e-4)
    # The same step at TP2 (sequence parallel): multi-latent attention's RoPE key gets every TP rank's gradient
    # (megarl.models.local_mla; 0.1% off without).
    assert report["sigmoid_tp2ep2"]["loss"] == pytest.approx(reference_loss, abs=1e-5)
    assert report["sigmoid_tp2ep2"]["grad_norm"] == pytest.approx(reference_grad_norm, rel=1e-4)
    before = torch.tensor(fixed["before"])
    assert before.abs().min() > 0 and torch.equal(torch.tensor(fixed["after"]), before)
    moved = torch.tensor(balanced["after"]) - torch.tensor(balanced["before"])
    assert torch.equal(torch.tensor(balanced["before"]), before)
    assert ((moved.abs() - 1e-3).abs() < 1e-6).float().mean() > 0.5 and (moved.abs() <= 1e-3 + 1e-6).all()
    assert balanced["moe/expert_bias_abs_mean"] == pytest.approx(torch.tensor(balanced["after"]).abs().mean().item())
    assert fixed["moe/expert_bias_abs_mean"] == pytest.approx(before.abs().mean().item())
    assert "moe/layer0/tokens_per_expert_max" not in fixed and "moe/layer1/tokens_per_expert_max" in fixed
