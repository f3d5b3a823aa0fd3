"""Load HF checkpoints into megatron at a layout and export them back (checked by the test).

Mixture-of-experts models are loaded with their experts spread over --ep ranks and split over
--etp ranks (dense models keep EP1).

Also checks that the shard shapes the resharding cost model (bench/resharding_cost_model.py) computes on
paper are the built model's, for every tensor mapped to HF (parameters and routers' correction biases).
"""

import argparse
import os
import sys
from pathlib import Path

import torch.distributed as dist

from megarl.distributed import finish_process, init_layout
from megarl.models.architecture import architecture_from_hf, read_hf_config
from megarl.models.hf_interop import export_hf, load_hf_model
from megarl.models.state_dict_adapter import mapped_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from resharding_cost_model import TrainingLayout, stage_shard_shapes  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--hf", nargs="+", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--ep", type=int, default=1, help="for the mixture-of-experts models")
parser.add_argument("--etp", type=int, default=0, help="for the mixture-of-experts models")
args = parser.parse_args()

for model_dir in args.hf:
    moe = architecture_from_hf(read_hf_config(model_dir)).is_moe
    layout = init_layout(tp=args.tp, pp=args.pp, ep=args.ep if moe else 1, etp=args.etp if moe else 0)
    model, arch = load_hf_model(model_dir, layout)
    built = {name: tuple(tensor.shape) for name, tensor in mapped_tensors(model, arch).items()}
    on_paper = stage_shard_shapes(arch, TrainingLayout(dist.get_world_size(), layout.tp, layout.pp, layout.ep,
                                                       layout.etp), layout.pp_rank)
    assert built == on_paper, f"{model_dir}: built {built} != cost model {on_paper}"
    export_hf(model, arch, layout, os.path.join(args.out, os.path.basename(model_dir)), model_dir)
finish_process()
