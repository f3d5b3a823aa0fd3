"""A megarl checkpoint's actor (or critic, as a value model) -> a HuggingFace directory.

    torchrun --nproc_per_node=N checkpoints_tools/convert_to_hf.py --checkpoint checkpoints/run/global_step_40 \\
        --output out/hf [--model critic] [--tp T --pp P --ep E --etp ET] [--verify] [--peft-output out/adapter]

The checkpoint is layout-independent: it loads at any TP x PP (x EP x ETP for mixture-of-experts
models) that fits the model, each rank reading its shards, and every pipeline stage writes its own
safetensors shard. The output has the model's config, tokenizer and generation config. `--verify`
compares the logits of the exported directory under `transformers` with the megarl model's (exit 1
above --tolerance). A model trained with LoRA adapters exports merged (W + (alpha / r) B A); `--peft-output`
writes its adapters as a PEFT adapter directory too, for its base model (the HF directory the run started from);
a critic's, with its trained value head, for that base as `AutoModelForTokenClassification` with num_labels=1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

from megarl.checkpoint.model_loading import load_model, lora_base_model, model_problem
from megarl.distributed import finish_process, init_layout
from megarl.engine.parity import max_difference
from megarl.models.hf_interop import export_hf
from megarl.models.lora import adapters_of
from megarl.models.peft_adapter import export_peft


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a global_step_N directory")
    parser.add_argument("--output", required=True)
    parser.add_argument("--model", choices=["actor", "critic"], default="actor")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    parser.add_argument("--etp", type=int, default=0, help="expert tensor-parallel size; 0: same as --tp")
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--peft-output", help="also write the model's LoRA adapters here as a PEFT adapter")
    args = parser.parse_args(argv)

    checkpoint = Path(args.checkpoint)
    problem = model_problem(checkpoint, args.model)  # before joining the world: one message, not one per rank
    if problem:
        sys.exit(f"convert_to_hf: {checkpoint} is not a usable checkpoint with a {args.model!r} model: {problem}")
    base_model = lora_base_model(checkpoint, args.model)
    if args.peft_output and base_model is None:
        sys.exit(f"convert_to_hf: --peft-output: the {args.model} of {checkpoint} has no LoRA adapters "
                 f"(its run's {args.model}.lora.rank is 0)")
    layout = init_layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    if dist.get_rank() == 0:
        print(f"loading {checkpoint / args.model} at {layout}", flush=True)
    model, arch = load_model(checkpoint, args.model, layout)
    export_hf(model, arch, layout, args.output, str(checkpoint / "hf"))
    if args.peft_output:
        adapters = list(adapters_of(model).values())
        value_head = model.output_layer.score if arch.value_model and layout.is_last_stage else None
        export_peft(adapters, adapters[0].settings, layout, args.peft_output, base_model, value_head)
        if dist.get_rank() == 0:
            print(f"wrote the LoRA adapters to {args.peft_output}", flush=True)
    status = 0
    if args.verify:
        difference = max_difference(model, arch, layout, args.output)
        status = int(difference > args.tolerance)
        if dist.get_rank() == 0:
            print(f"verify: max |megarl - transformers({args.output})| = {difference:.3e} "
                  f"({'OK' if not status else 'FAIL'}, tolerance {args.tolerance:g})", flush=True)
    elif dist.get_rank() == 0:
        print(f"wrote {args.output}", flush=True)
    return status


if __name__ == "__main__":
    finish_process(main())
