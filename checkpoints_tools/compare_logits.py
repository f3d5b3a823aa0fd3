"""Check that megatron-core at a TP x PP layout computes the same logits as `transformers`.

    torchrun --nproc_per_node=4 checkpoints_tools/compare_logits.py --hf DIR [DIR ...] --tp 2 --pp 2
    torchrun --nproc_per_node=4 checkpoints_tools/compare_logits.py --hf MOE_DIR [DIR ...] --tp 2 --ep 2 [--etp 1]

Each HF checkpoint is loaded into megatron at the layout (each rank reading only its slices), a
batch of prompts runs through the pipeline, and one last-stage rank compares the real-vocabulary
logits of real tokens (value models: the values) with a `transformers` forward on the same
weights. Prints one line per model; exits 1 when any difference exceeds --tolerance: a number, or
`Nx` for N times the error `transformers` itself makes in --dtype on this device (against its fp32 on
the CPU), the bound for bf16, whose rounding differs between kernels and devices.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch.distributed as dist

from megarl.config.schema import DTYPES, LAYER_SPECS
from megarl.distributed import finish_process, init_layout
from megarl.engine.parity import max_difference, transformers_error
from megarl.models.builder import TORCH_DTYPES
from megarl.models.hf_interop import load_hf_model


@dataclass(frozen=True)
class Multiple:
    """A tolerance of `factor` times transformers' own error in the compared dtype."""

    factor: float


def tolerance_arg(text: str) -> float | Multiple:
    return Multiple(float(text[:-1])) if text.endswith("x") else float(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", nargs="+", required=True, help="HuggingFace model directories")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    parser.add_argument("--etp", type=int, default=0, help="expert tensor-parallel size; 0: same as --tp")
    parser.add_argument("--tolerance", type=tolerance_arg, default=1e-4,
                        help="a number, or Nx: N times transformers' own error in --dtype on this device")
    parser.add_argument("--layer-spec", choices=LAYER_SPECS, default="auto")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="megatron's; transformers runs in fp32")
    args = parser.parse_args(argv)

    layout = init_layout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    failed = False
    for model_dir in args.hf:
        model, arch = load_hf_model(model_dir, layout, args.dtype, layer_spec=args.layer_spec)
        difference = max_difference(model, arch, layout, model_dir)
        tolerance, basis = args.tolerance, ""
        if isinstance(tolerance, Multiple):
            own_error = transformers_error(model_dir, arch.value_model, TORCH_DTYPES[args.dtype])
            tolerance, basis = tolerance.factor * own_error, f" = {tolerance.factor:g}x transformers' {own_error:.3e}"
        ok = difference <= tolerance
        failed |= not ok
        if dist.get_rank() == 0:
            verdict = "OK" if ok else "FAIL"
            print(f"{verdict} {model_dir} {layout} {args.dtype}: max |megatron - transformers| = {difference:.3e} "
                  f"(tolerance {tolerance:.3g}{basis})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    finish_process(main())
