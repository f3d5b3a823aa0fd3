"""LoRA at one layout against PEFT, on a PEFT adapter whose A and B are both non-zero (on a mixture of experts, the
routed experts' too):

- the actor's logits with the adapter imported equal PEFT's on the same base (fp32), and with the adapters off
  `transformers`' base model's (the reference model a LoRA run uses);
- the adapter exported back is bit-identical to the one imported;
- one optimizer step changes the adapters alone (every base weight bitwise the same), its gradient norm is PEFT's
  for the same loss, and the gradient buffers the optimizer steps over hold the adapters' elements alone;
- the weights the rollout engine is served are W + (alpha / r) B A of PEFT's merged model.

Prints one JSON line (rank 0).
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.config.schema import EngineConfig, LoRAConfig, ModelConfig, OptimizerConfig
from megarl.distributed import collectives, finish_process, init_layout
from megarl.engine.batch import SequenceBatch
from megarl.engine.forward import forward_outputs, gather_vocab
from megarl.engine.megatron_engine import MegatronEngine
from megarl.engine.parity import tokenize
from megarl.models.hf_interop import gather_hf_state_dict
from megarl.models.lora import EXPERT_TARGETS, adapters_disabled, merged_weights
from megarl.models.peft_adapter import WEIGHTS_FILE, export_peft
from reporting import print_report

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--adapter", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--ep", type=int, default=1)
args = parser.parse_args()

layout = init_layout(tp=args.tp, pp=args.pp, ep=args.ep)
adapter_config = json.loads((Path(args.adapter) / "adapter_config.json").read_text())
# PEFT names a routed expert's targets by transformers' fused weights (target_parameters).
targets = {*adapter_config["target_modules"],
           *(target for weight in adapter_config.get("target_parameters") or [] for target in EXPERT_TARGETS[weight])}
lora = LoRAConfig(rank=adapter_config["r"], alpha=adapter_config["lora_alpha"], target_modules=sorted(targets),
                  adapter_path=args.adapter)
engine = MegatronEngine(layout, ModelConfig(path=args.model, layer_spec="local"),
                        EngineConfig(micro_batch_size_per_rank=2, optim=OptimizerConfig(lr=1e-2), lora=lora),
                        total_optimizer_steps=10)
tokens_BT, mask_BT = tokenize(args.model)
base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
with torch.no_grad():
    base_logits = base(tokens_BT).logits
    peft_model = PeftModel.from_pretrained(base, args.adapter).eval()
    peft_logits = peft_model(tokens_BT).logits


def largest_difference(expected: torch.Tensor) -> float:
    """max |megatron - expected| over real tokens, the same on every rank."""
    engine.module.eval()
    outputs = forward_outputs(engine.module, layout, tokens_BT, micro_batch_size=2)
    difference = torch.zeros(1)
    if layout.is_last_stage:
        logits = gather_vocab(outputs, layout)[..., : engine.arch.vocab_size]
        difference[0] = (logits.float() - expected)[mask_BT].abs().max()
    collectives.all_reduce(difference, op=dist.ReduceOp.MAX)
    return difference.item()


report = {"adapted_logits_diff": largest_difference(peft_logits)}
with adapters_disabled(engine.module):
    report["base_logits_diff"] = largest_difference(base_logits)
report["peft_vs_base_logits_diff"] = (peft_logits - base_logits)[mask_BT].abs().max().item()



def per_expert(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert weights as a checkpoint names them, one tensor per expert and projection."""
    named = {}
    for name, tensor in state_dict.items():
        if name.endswith(".experts.gate_up_proj"):
            for expert, (gate, up) in enumerate(weight.chunk(2) for weight in tensor):
                named[name.replace("gate_up_proj", f"{expert}.gate_proj.weight")] = gate
                named[name.replace("gate_up_proj", f"{expert}.up_proj.weight")] = up
        elif name.endswith(".experts.down_proj"):
            named.update((name.replace("down_proj", f"{expert}.down_proj.weight"), down)
                         for expert, down in enumerate(tensor))
        else:
            named[name] = tensor
    return named


# The served weights, gathered whole: PEFT's merged model.
merged = per_expert(peft_model.merge_and_unload().state_dict())
engine_view = gather_hf_state_dict(engine.module, engine.arch, layout)
report["served_vs_peft_merged_diff"] = max((tensor - merged[name]).abs().max().item()
                                           for name, tensor in engine_view.items())
report["merged_weights"] = len(merged_weights(engine.module))

export_peft(engine.adapters, engine.adapters[0].settings, layout, Path(args.out) / "exported", args.model)
if dist.get_rank() == 0:
    imported = load_file(Path(args.adapter) / WEIGHTS_FILE)
    exported = load_file(Path(args.out) / "exported" / WEIGHTS_FILE)
    report["exported_names_equal"] = sorted(imported) == sorted(exported)
    report["exported_bit_identical"] = all(torch.equal(imported[name], exported[name]) for name in imported)

# One optimizer step.
generator = torch.Generator().manual_seed(0)
# Eight sequences: enough tokens that the router sends some to every expert of every layer.
batch = SequenceBatch(torch.randint(5, 100, (8, 24), generator=generator), torch.tensor([4, 6, 3, 5, 7, 2, 8, 4]),
                      torch.tensor([9, 12, 5, 14, 16, 20, 10, 19]))
base_before = {name: p.detach().clone() for name, p in engine.module.named_parameters() if not p.requires_grad}
adapters_before = {name: p.detach().clone() for name, p in engine.module.named_parameters() if p.requires_grad}


def negative_log_likelihood(outputs, micro_batch, normalizer):
    mask = micro_batch.response_mask_BR.to(outputs["logprobs"].device)
    return -(outputs["logprobs"] * mask).sum() / normalizer.num_tokens, {}


def peft_gradient_norm() -> float:
    """The same loss's gradient norm over PEFT's adapters (every response token's negative log-likelihood, a mean)."""
    base_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base_model, args.adapter, is_trainable=True).train()
    tokens = batch.response_lengths_B.sum()
    loss = 0.0
    for i in range(len(batch)):
        prompt, response = int(batch.prompt_lengths_B[i]), int(batch.response_lengths_B[i])
        logits = peft_model(batch.tokens_BT[i:i + 1, :prompt + response]).logits[0, prompt - 1:prompt + response - 1]
        targets = batch.tokens_BT[i, prompt:prompt + response]
        loss = loss - torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum() / tokens
    loss.backward()
    return torch.cat([p.grad.flatten() for name, p in peft_model.named_parameters() if "lora_" in name]).norm().item()


report["peft_grad_norm"] = peft_gradient_norm()
engine.module.train()
metrics, _ = engine.train_mini_batch(batch, negative_log_likelihood)
report["base_unchanged"] = all(torch.equal(p, base_before[name]) for name, p in engine.module.named_parameters()
                               if name in base_before)
report["adapters_changed"] = all(not torch.equal(p, adapters_before[name])
                                 for name, p in engine.module.named_parameters() if name in adapters_before)
report["trainable_names_are_adapters"] = all(".lora_" in name for name in adapters_before)
report["adapter_elements"] = sum(p.numel() for p in adapters_before.values())
report["grad_buffer_elements"] = sum(parameter.numel() for buffer in engine.model.buffers +
                                     engine.model.expert_parallel_buffers for parameter in buffer.params)
report["grad_norm"] = metrics["grad_norm"]
every_rank = collectives.all_gather_object(report)
if dist.get_rank() == 0:
    print_report(every_rank)
finish_process()
