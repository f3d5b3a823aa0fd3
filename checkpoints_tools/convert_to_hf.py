"""A megarl checkpoint's actor (or critic, as a value model) -> a HuggingFace directory.

    torchrun --nproc_per_node=N checkpoints_tools/convert_to_hf.py --checkpoint checkpoints/run/global_step_40 \\
        --output out/hf [--model critic] [--tp T --pp P] [--verify]

The checkpoint is layout-independent: it loads at any TP x PP that fits the model, each rank
reading its shards, and every pipeline stage writes its own safetensors shard. The output has the
model's config, tokenizer and generation config. `--verify` compares the logits of the exported
directory under `transformers` with the megarl model's (exit 1 above --tolerance).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megarl.checkpoint.directory import problem_with
from megarl.distributed import init_layout
from megarl.engine.parity import max_difference
from megarl.models.architecture import architecture_from_hf, read_hf_config
from megarl.models.builder import build_model
from megarl.models.hf_interop import export_hf


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a global_step_N directory")
    parser.add_argument("--output", required=True)
    parser.add_argument("--model", choices=["actor", "critic"], default="actor")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)

    checkpoint = Path(args.checkpoint)
    problem = problem_with(checkpoint) if checkpoint.is_dir() else "no such directory"
    if problem or not (checkpoint / args.model).is_dir():
        sys.exit(f"convert_to_hf: {checkpoint} is not a usable checkpoint with a {args.model!r} model: "
                 f"{problem or 'missing ' + args.model}")
    layout = init_layout(tp=args.tp, pp=args.pp)
    arch = architecture_from_hf(read_hf_config(str(checkpoint / "hf")), source=str(checkpoint / "hf/config.json"))
    if args.model == "critic":
        arch = dataclasses.replace(arch, value_model=True, tie_word_embeddings=False)
    model = build_model(arch, layout)
    if dist.get_rank() == 0:
        print(f"loading {checkpoint / args.model} at {layout}", flush=True)
    with torch.no_grad():
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(checkpoint / args.model))
        model.load_state_dict(loaded["model"])
    export_hf(model, arch, layout, args.output, str(checkpoint / "hf"))
    status = 0
    if args.verify:
        difference = max_difference(model, arch, layout, args.output)
        status = int(difference > args.tolerance)
        if dist.get_rank() == 0:
            print(f"verify: max |megarl - transformers({args.output})| = {difference:.3e} "
                  f"({'OK' if not status else 'FAIL'}, tolerance {args.tolerance:g})", flush=True)
    elif dist.get_rank() == 0:
        print(f"wrote {args.output}", flush=True)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
