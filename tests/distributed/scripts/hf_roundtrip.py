"""Load HF checkpoints into megatron at a layout and export them back (checked by the test)."""

import argparse
import os

import torch.distributed as dist

from megarl.distributed import init_layout
from megarl.models.hf_interop import export_hf, load_hf_model

parser = argparse.ArgumentParser()
parser.add_argument("--hf", nargs="+", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--pp", type=int, default=1)
args = parser.parse_args()

layout = init_layout(tp=args.tp, pp=args.pp)
for model_dir in args.hf:
    model, arch = load_hf_model(model_dir, layout)
    export_hf(model, arch, layout, os.path.join(args.out, os.path.basename(model_dir)), model_dir)
dist.destroy_process_group()
