"""A tiny MoE policy trained at EP1 and EP2 in one 2-process world (DP2 both times), against `transformers`.

Phases, each after `init_layout` at its EP size:
1. EP1, then EP2: score the batch (vs `transformers`), one AdamW step with the load-balancing loss and
   the z-loss on, exported to HF. Reported: the step's metrics and the scores' difference.
   Before the step, scoring of uneven shares (DP ranks with 2 and 3 micro-batches); after it, a step
   that DP rank 1 sits out (its zero-weight stand-in repeated: expert parallelism needs equal
   micro-batch counts).
   Then TP2xEP2 (DP1, each expert whole: ETP1; sequence parallel): the same step on the whole batch
   in the DP2 runs' micro-batches, and an MoE critic's values and one step of a squared-value loss.
2. EP2: a checkpoint after those two steps, then steps 3 and 4; a fresh engine loads the checkpoint and
   takes step 3 again (exact resume). Across EP sizes: EP1's checkpoint (after the same two steps)
   resumed at EP2, and EP2's resumed at EP1, each take steps 3 and 4.
3. EP2 with aux-loss-free balancing: the expert bias after one step.
4. Router replay, with routers perturbed (the same noise at every layout) so that their own routing
   differs from the "rollout's" (HF's routing of the unperturbed model, recorded for all positions
   but each sequence's last): one step at EP2 without replay, one with replay, and one with replay
   at PP2 (DP1) with full recomputation, whose 1F1B schedule recomputes micro-batch 0 after micro-batch
   1's forward. A hook on the routers records the routing each training forward used.
5. The sigmoid router of DeepSeek-V3 (--sigmoid-policy: correction bias, expert groups, a dense first
   layer) at EP2: replay as in 4; and its checkpoint's correction bias after one step, fixed by default
   and moved by aux-loss-free balancing with `expert_bias`; the fixed-bias step again at TP2xEP2 (multi-latent
   attention at TP2, sequence parallel).

The reference (every rank, whole batch) is a `transformers` forward and backward of the same loss
written out by hand: the policy loss normalised by the batch's response tokens, plus each
micro-batch's router losses (megatron's definitions, computed from HF's router logits) weighted by
its share of the batch's tokens. It gives the gradient norm, the router-loss values, the tokens per
expert and the expert bias the engine must reproduce.
"""

import argparse
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from megarl.checkpoint import Checkpointer
from megarl.config.schema import EngineConfig, ModelConfig, MoEConfig, OptimizerConfig
from megarl.distributed import finish_process, init_layout
from megarl.engine.batch import SequenceBatch
from megarl.engine.batching import balance_over_data_parallel, fixed_micro_batches
from megarl.engine.megatron_engine import MegatronEngine
from megarl.engine.prompt_sharing import PromptGroups
from megarl.models.hf_interop import export_hf
from reporting import print_report


TEMPERATURE, AUX, Z, BIAS_RATE = 0.7, 0.1, 0.01, 1e-3  # BIAS_RATE: megatron's default update rate
MICRO_BATCH = 2
generator = torch.Generator().manual_seed(0)
prompt_lengths = torch.tensor([5, 3, 8, 4, 6, 2, 7, 3])
response_lengths = torch.tensor([10, 12, 6, 15, 1, 9, 4, 13])
lengths = prompt_lengths + response_lengths
tokens = torch.randint(5, 100, (8, 24), generator=generator)
# Fixed-size micro-batches: the reference takes the router losses over the same micro-batches.
engine_config = EngineConfig(micro_batch_size_per_rank=MICRO_BATCH, use_dynamic_batch_size=False,
                             optim=OptimizerConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0, weight_decay=0.01))
moe_losses = MoEConfig(aux_loss_coeff=AUX, z_loss_coeff=Z)


def shares(dp):
    return balance_over_data_parallel(lengths.tolist(), dp)


def policy_loss(outputs, micro_batch, normalizer):
    mask = micro_batch.response_mask_BR.to(outputs["logprobs"].device)
    entropy = (outputs["entropy"] * mask).sum() / normalizer.num_tokens
    nll = -(outputs["logprobs"] * mask).sum() / normalizer.num_tokens
    return nll - 0.01 * entropy, {"entropy": entropy}


def reference(model_dir, dp):
    """`transformers`: the step's policy loss, gradient norm, per-layer router losses (means over the
    micro-batches) and tokens per expert."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_layers, num_experts, topk = (model.config.num_hidden_layers, model.config.num_experts,
                                     model.config.num_experts_per_tok)
    num_response, num_all = int(response_lengths.sum()), int(lengths.sum())
    main, routers = torch.zeros(()), torch.zeros(())
    aux_LM, z_LM, tokens_LE = [], [], torch.zeros(num_layers, num_experts)
    sigmoid_tokens_LE = torch.zeros(num_layers, num_experts)
    for share in shares(dp):
        for micro in fixed_micro_batches(list(range(len(share))), MICRO_BATCH):
            logits_per_layer = [[] for _ in range(num_layers)]
            for i in (share[k] for k in micro):
                length, start = int(lengths[i]), int(prompt_lengths[i])
                result = model(tokens[i : i + 1, :length], output_router_logits=True)
                log_p = torch.log_softmax(result.logits[0, start - 1 : length - 1] / TEMPERATURE, dim=-1)
                logprobs = log_p.gather(1, tokens[i, start:length, None]).squeeze(1)
                entropy = -(log_p.exp() * log_p).sum(-1)
                main = main + (-logprobs.sum() - 0.01 * entropy.sum()) / num_response
                for layer, router_logits in enumerate(result.router_logits):
                    logits_per_layer[layer].append(router_logits.view(length, num_experts))
            aux_L, z_L = [], []
            for layer, parts in enumerate(logits_per_layer):
                logits_NE = torch.cat(parts)
                n = logits_NE.shape[0]
                scores_NE = torch.softmax(logits_NE, dim=-1)
                routed_NE = torch.zeros_like(scores_NE).scatter(1, scores_NE.topk(topk, dim=1).indices, 1.0)
                tokens_LE[layer] += routed_NE.sum(0)
                # aux-loss-free balancing routes by sigmoid scores (megarl.models.builder): ties may differ
                sigmoid_topk = torch.sigmoid(logits_NE).topk(topk, dim=1).indices
                sigmoid_tokens_LE[layer] += torch.zeros_like(scores_NE).scatter(1, sigmoid_topk, 1.0).sum(0)
                # megatron's switch_load_balancing_loss_func and z_loss_func, without their coefficients
                aux_L.append(num_experts / (topk * n * n) * (scores_NE.sum(0) * routed_NE.sum(0)).sum())
                z_L.append(torch.logsumexp(logits_NE, dim=-1).square().mean())
            share_of_tokens = n / num_all
            routers = routers + share_of_tokens * (AUX * torch.stack(aux_L).sum() + Z * torch.stack(z_L).sum())
            aux_LM.append(torch.stack(aux_L).detach())
            z_LM.append(torch.stack(z_L).detach())
    (main + routers).backward()
    grad_norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
    return {"loss": float(main), "grad_norm": float(grad_norm), "load_balancing_loss": torch.stack(aux_LM, 1).mean(1),
            "z_loss": torch.stack(z_LM, 1).mean(1), "tokens_LE": tokens_LE,
            "sigmoid_tokens_LE": sigmoid_tokens_LE}


def value_loss(outputs, micro_batch, normalizer):
    mask = micro_batch.response_mask_BR.to(outputs["values"].device)
    return (outputs["values"] * mask).square().sum() / normalizer.num_tokens, {}


def hf_value_step(model_dir):
    """`transformers`: (8, R) values of the response tokens and the gradient norm of `value_loss` on the batch."""
    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32)
    values, loss = torch.zeros(8, int(response_lengths.max())), torch.zeros(())
    for i in range(8):
        length, start = int(lengths[i]), int(prompt_lengths[i])
        values_R = model(tokens[i : i + 1, :length]).logits[0, start - 1 : length - 1, 0]
        values[i, : length - start] = values_R.detach()
        loss = loss + values_R.square().sum() / int(response_lengths.sum())
    loss.backward()
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return values, float(torch.sqrt(sum(grad.square().sum() for grad in grads)))


def response_log_p(model, i):
    """(R_i, V) log-probabilities at TEMPERATURE of sequence i's response positions, `transformers` forward."""
    length, start = int(lengths[i]), int(prompt_lengths[i])
    return torch.log_softmax(model(tokens[i : i + 1, :length]).logits[0, start - 1 : length - 1] / TEMPERATURE, -1)


def response_tokens(i):
    return tokens[i, int(prompt_lengths[i]) : int(lengths[i]), None]


def hf_scores(model_dir):
    """(8, R) log-probs at TEMPERATURE from a `transformers` forward on each sequence."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logprobs = torch.zeros(8, int(response_lengths.max()))
    with torch.no_grad():
        for i in range(8):
            logprobs[i, : int(response_lengths[i])] = response_log_p(model, i).gather(1, response_tokens(i)).squeeze(1)
    return logprobs


def hf_policy_step(model_dir):
    """`transformers`: the policy loss of the whole batch (no router losses) and its gradient norm."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss, num_response = torch.zeros(()), int(response_lengths.sum())
    for i in range(8):
        log_p = response_log_p(model, i)
        logprobs = log_p.gather(1, response_tokens(i)).squeeze(1)
        loss = loss + (-logprobs.sum() + 0.01 * (log_p.exp() * log_p).sum()) / num_response
    loss.backward()
    return float(loss), float(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters()
                                             if p.grad is not None)))


def worst(value: float) -> float:
    """The largest `value` over all ranks."""
    box = torch.tensor(value)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box)


def weights_diff(a, b) -> float:
    return worst(max(float((p - q).abs().max()) for p, q in zip(a.module.parameters(), b.module.parameters())))


def local_batch(layout):
    share = shares(layout.dp)[layout.dp_rank]
    return share, SequenceBatch(tokens, prompt_lengths, response_lengths).select(share)


def engine(layout, policy, moe=moe_losses):
    """A policy built as an RL run builds it, for groups of 8 samples of these prompts (which a dense model shares)."""
    groups = PromptGroups(8, int(prompt_lengths.max()), int(response_lengths.max()))
    return MegatronEngine(layout, ModelConfig(path=policy, moe=moe), engine_config, total_optimizer_steps=10,
                          groups=groups)


def checkpointer(root, policy):
    return Checkpointer(root, policy, Path(policy) / "config.json", max_to_keep=0)


def resumed_steps(layout, policy, directory, batch):
    """The metrics of two steps of an engine resumed from `directory` (the second shows the Adam state)."""
    resumed = engine(layout, policy)
    checkpointer(directory.parent, policy).load(directory, {"actor": resumed})
    return [resumed.train_mini_batch(batch, policy_loss, temperature=TEMPERATURE)[0] for _ in range(2)]


def hf_routing(model_dir):
    """(8, 24, L, k) int16: the experts `transformers` routes each token to (the indices each MoE layer's
    router returns), for all positions but each sequence's last, as a rollout engine records them;
    experts 0..k-1 elsewhere and in dense layers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_layers, topk = model.config.num_hidden_layers, model.config.num_experts_per_tok
    routed = torch.arange(topk, dtype=torch.int16).repeat(8, tokens.shape[1], num_layers, 1)
    chosen = {}
    for layer, decoder_layer in enumerate(model.model.layers):
        if hasattr(decoder_layer.mlp, "gate"):
            decoder_layer.mlp.gate.register_forward_hook(
                lambda module, args, output, layer=layer: chosen.__setitem__(layer, output[2]))
    with torch.no_grad():
        for i in range(8):
            length = int(lengths[i])
            model(tokens[i : i + 1, :length])
            for layer, ids_NK in chosen.items():
                routed[i, : length - 1, layer] = ids_NK[: length - 1].short()
    return routed


def perturb_routers(policy):
    """Noise on every router's weight, seeded by its layer: routes near-ties differently, the same at any layout."""
    for router in policy.routing.routers:
        noise = torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(router.layer_number))
        with torch.no_grad():
            router.weight.add_(0.3 * float(router.weight.std()) * noise)


def replay_step(layout, policy_dir, batch, replay, recompute=False):
    """One step on `batch` (this DP rank's share: `micro_batches` index it) with perturbed routers: its
    metrics and, from a hook, the number of recorded (token, layer) pairs whose training routing
    differs from the rollout's and their count (all sequences' first n - 1 positions). Under sequence
    parallelism each TP rank's routers see its slice of the positions."""
    # Without router losses, which megatron takes per micro-batch: the step is then the same at any layout.
    config = replace(engine_config, recompute_activations=recompute)
    policy = MegatronEngine(layout, ModelConfig(path=policy_dir), config, total_optimizer_steps=10,
                            router_replay=replay)
    perturb_routers(policy)
    calls = []  # (layer, (T / TP * b, E) routing map) of each training forward, in order
    for router in policy.routing.routers:
        router.register_forward_hook(lambda module, args, output: calls.append(
            (module.layer_number - 1, output[1].detach().cpu())) if torch.is_grad_enabled() else None)
    metrics, _ = policy.train_mini_batch(batch, policy_loss, temperature=TEMPERATURE)
    differing = recorded = 0
    micro = fixed_micro_batches(list(range(len(batch))), MICRO_BATCH)
    layers_here = len(policy.routing.routers)
    for m, indices in enumerate(micro):
        for layer, routing_map in calls[m * layers_here : (m + 1) * layers_here]:
            width = routing_map.shape[0] // len(indices)
            map_bTE = routing_map.view(width, len(indices), -1).transpose(0, 1)
            first = layout.tp_rank * width if policy.sequence_multiple > 1 else 0
            for row, i in enumerate(indices):
                n = max(0, min(int(batch.sequence_lengths_B[i]) - 1, first + width) - first)
                expected = torch.zeros(n, map_bTE.shape[-1], dtype=torch.bool).scatter(
                    1, batch.routed_experts_BTLK[i, first : first + n, layer].long(), True)
                differing += int((map_bTE[row, :n] != expected).any(-1).sum())
                recorded += n
    assert len(calls) == len(micro) * layers_here, (len(calls), len(micro), layers_here)
    counts = torch.tensor([float(differing), float(recorded)])
    sequence_parallel = [layout.tp_group] if policy.sequence_multiple > 1 else []
    for group in sequence_parallel + [layout.pp_group, layout.dp_group]:
        dist.all_reduce(counts, group=group)
    return dict(metrics, differing=counts[0].item(), recorded=counts[1].item())


def main():
    """The phases; a function so that checkpoint writers, which re-import this module, run nothing."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", required=True)
    parser.add_argument("--value", required=True, help="an MoE value model")
    parser.add_argument("--sigmoid-policy", required=True, help="a DeepSeek-V3 model")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    report = {}
    expected = hf_scores(args.policy)
    everything = SequenceBatch(tokens, prompt_lengths, response_lengths)
    for ep in (1, 2):
        layout = init_layout(ep=ep)
        share, batch = local_batch(layout)
        policy = engine(layout, args.policy)
        scores = policy.score(batch, temperature=TEMPERATURE)["logprobs"]
        score_diff = worst(float((scores - expected[share, : scores.shape[1]]).abs().max()))
        # Uneven shares: DP ranks with 2 and 3 micro-batches.
        uneven = [0, 1, 2] if layout.dp_rank == 0 else [3, 4, 5, 6, 7]
        scores = policy.score(everything.select(uneven), temperature=TEMPERATURE)["logprobs"]
        uneven_diff = worst(float((scores - expected[uneven, : scores.shape[1]]).abs().max()))
        metrics, _ = policy.train_mini_batch(batch, policy_loss, temperature=TEMPERATURE)
        export_hf(policy.module, policy.arch, layout, str(out / f"ep{ep}"), args.policy)
        report[f"ep{ep}"] = dict(metrics, score_diff=score_diff, uneven_score_diff=uneven_diff,
                                 shares_prompts=policy.positioned_rope is not None)
        # A step that DP rank 1 sits out with a stand-in.
        report[f"ep{ep}"]["idle_step"], _ = policy.train_mini_batch(everything.select(uneven[:3]), policy_loss,
                                                                    temperature=TEMPERATURE, idle=layout.dp_rank == 1)
        if ep == 1:  # for a resume at EP2 (phase 2)
            checkpointer(out / "checkpoints_ep1", args.policy).save(2, {"actor": policy}, {})

    # Phase 1b: TP2xEP2 (DP1, ETP1: sequence parallel) on the whole batch, cut into the DP2 runs' micro-batches.
    tp_layout = init_layout(tp=2, ep=2, etp=1)
    order = [i for share in shares(2) for i in share]
    tp_policy = engine(tp_layout, args.policy)
    scores = tp_policy.score(everything.select(order), temperature=TEMPERATURE)["logprobs"]
    score_diff = worst(float((scores - expected[order, : scores.shape[1]]).abs().max()))
    metrics, _ = tp_policy.train_mini_batch(everything.select(order), policy_loss, temperature=TEMPERATURE)
    export_hf(tp_policy.module, tp_policy.arch, tp_layout, str(out / "tp2ep2"), args.policy)
    report["tp2ep2"] = dict(metrics, score_diff=score_diff)
    critic = MegatronEngine(tp_layout, ModelConfig(path=args.value), engine_config, total_optimizer_steps=10)
    values = critic.score(everything)["values"]
    expected_values, report["critic_reference_grad_norm"] = hf_value_step(args.value)
    report["critic_value_diff"] = worst(float((values - expected_values[:, : values.shape[1]]).abs().max()))
    report["critic_step"], _ = critic.train_mini_batch(everything, value_loss)
    layout = init_layout(ep=2)

    # Phase 2 (EP2): checkpoint after two steps, then step 3; resumed, step 3 again.
    checkpointer(out / "checkpoints", args.policy).save(2, {"actor": policy}, {})
    report["step3"], _ = policy.train_mini_batch(batch, policy_loss, temperature=TEMPERATURE)
    resumed = engine(layout, args.policy)
    checkpointer(out / "checkpoints", args.policy).load(out / "checkpoints/global_step_2", {"actor": resumed})
    report["step3_resumed_ep2"], _ = resumed.train_mini_batch(batch, policy_loss, temperature=TEMPERATURE)
    report["weights_diff_resumed_ep2"] = weights_diff(policy, resumed)
    report["step4"], _ = policy.train_mini_batch(batch, policy_loss, temperature=TEMPERATURE)
    # Resumes across EP sizes (chained optimizer at EP2, single at EP1): steps 3 and 4 again.
    report["resumed_from_ep1"] = resumed_steps(layout, args.policy, out / "checkpoints_ep1/global_step_2", batch)
    ep1_layout = init_layout(ep=1)
    report["resumed_at_ep1"] = resumed_steps(ep1_layout, args.policy, out / "checkpoints/global_step_2",
                                             local_batch(ep1_layout)[1])
    layout = init_layout(ep=2)

    # Phase 3 (EP2): aux-loss-free balancing moves each expert's bias by the update rate towards equal loads.
    balanced = engine(layout, args.policy, MoEConfig(expert_bias=True))
    report["bias_step"], _ = balanced.train_mini_batch(batch, policy_loss, temperature=TEMPERATURE)
    report["expert_bias_LE"] = [router.expert_bias.tolist() for router in balanced.routing.routers]

    # Phase 4: router replay against perturbed routers, at EP2 and at PP2 with recomputation.
    routed = SequenceBatch(tokens, prompt_lengths, response_lengths, routed_experts_BTLK=hf_routing(args.policy))
    share = local_batch(layout)[0]
    report["own_routing"] = replay_step(layout, args.policy, routed.select(share), replay=False)
    report["replayed"] = replay_step(layout, args.policy, routed.select(share), replay=True)
    report["replayed_pp2"] = replay_step(init_layout(pp=2), args.policy, routed, replay=True, recompute=True)
    report["replayed_tp2ep2"] = replay_step(init_layout(tp=2, ep=2, etp=1), args.policy, routed, replay=True)

    # Phase 5 (EP2): DeepSeek-V3's sigmoid router with its correction bias and groups.
    layout = init_layout(ep=2)
    sigmoid_routed = replace(routed, routed_experts_BTLK=hf_routing(args.sigmoid_policy))
    report["sigmoid_own_routing"] = replay_step(layout, args.sigmoid_policy, sigmoid_routed.select(share), replay=False)
    report["sigmoid_replayed"] = replay_step(layout, args.sigmoid_policy, sigmoid_routed.select(share), replay=True)
    for name, moe in (("sigmoid_bias_fixed", MoEConfig()), ("sigmoid_bias_balanced", MoEConfig(expert_bias=True))):
        sigmoid = engine(layout, args.sigmoid_policy, moe)
        before = [router.expert_bias.tolist() for router in sigmoid.routing.routers]
        scores = sigmoid.score(batch, temperature=TEMPERATURE)["logprobs"]
        metrics, _ = sigmoid.train_mini_batch(batch, policy_loss, temperature=TEMPERATURE)
        report[name] = dict(metrics, before=before, after=[router.expert_bias.tolist()
                                                           for router in sigmoid.routing.routers])
    # At TP2 (sequence parallel, DP1) on the whole batch: every TP rank's heads use the whole RoPE key of MLA.
    sigmoid_tp = engine(init_layout(tp=2, ep=2, etp=1), args.sigmoid_policy, MoEConfig())
    report["sigmoid_tp2ep2"], _ = sigmoid_tp.train_mini_batch(everything.select(order), policy_loss,
                                                              temperature=TEMPERATURE)
    layout = init_layout(ep=2)
    expected = hf_scores(args.sigmoid_policy)[share]
    report["sigmoid_score_diff"] = worst(float((scores - expected[:, : scores.shape[1]]).abs().max()))
    report["sigmoid_reference"] = hf_policy_step(args.sigmoid_policy)

    reference_step = reference(args.policy, layout.dp)
    report["reference"] = {name: value.tolist() if torch.is_tensor(value) else value
                           for name, value in reference_step.items()}
    if dist.get_rank() == 0:
        print_report(report)
    finish_process()


if __name__ == "__main__":
    main()
