"""A HuggingFace directory -> a megarl (weights-only) checkpoint, saved from a chosen layout.

    torchrun --nproc_per_node=N checkpoints_tools/convert_from_hf.py --hf DIR --output checkpoints/run \\
        [--tp T --pp P --ep E --etp ET]

Writes `<output>/global_step_0/` with the `actor` model as a megatron-core dist checkpoint (each
rank saving only its shards), the HF config and tokenizer in `hf/`, and a manifest, published
atomically like the trainer's checkpoints. It holds no optimizer or trainer state: use it with
convert_to_hf.py, or load its weights at any layout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing

from megarl.checkpoint.checkpointer import start_writer_results_queue
from megarl.checkpoint.staging import begin, finish
from megarl.distributed import finish_process, init_layout
from megarl.models.hf_interop import load_hf_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True)
    parser.add_argument("--output", required=True, help="checkpoint root; global_step_0 is written inside")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    parser.add_argument("--etp", type=int, default=0, help="expert tensor-parallel size; 0: same as --tp")
    args = parser.parse_args(argv)

    layout = init_layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    root, source = Path(args.output), Path(args.hf)
    model, _ = load_hf_model(args.hf, layout)
    staging = begin(root, 0, ["actor"])
    start_writer_results_queue()  # megatron's own is a spawned process that would outlive this one
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(staging / "actor"))
    published = finish(root, 0, source)
    if dist.get_rank() == 0:
        print(f"wrote {published} from {layout}", flush=True)
    return 0


if __name__ == "__main__":
    finish_process(main())
