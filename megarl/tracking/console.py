"""What a run prints: a progress bar of the steps, a metrics line now and then, little else.

Rank 0 shows one tqdm bar (rate and ETA) and writes metric lines above it with `tqdm.write`, so the
two never overwrite each other. A line is printed every `trainer.log_freq` steps, at the last step
and whenever validation metrics are present; mlflow still receives every step (see `Tracker`).

`quiet_third_party_logs` is called by the launchers before the libraries are imported: their INFO
logs go, and a few warnings that fire on every CPU run for a known, harmless reason are filtered,
each with the reason next to it. Anything else they warn about still shows.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator

from tqdm import tqdm

CONSOLE_KEYS = ("sft/nll", "reward/mean", "val/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
                "response_length/mean", "mismatch/logprob_abs_diff_max", "actor/moe/load_max_over_mean",
                "actor/moe/load_balancing_loss", "actor/moe/z_loss", "actor/moe/routing_agreement", "timing/step",
                "throughput/tokens_per_s", "teacher/reverse_kl")

# (message regex, category, module regex): each fires once per process on every CPU run, for the reason given.
_KNOWN_WARNINGS = (
    # The CPU build has neither; `python -m megarl.doctor` reports which fallbacks are active.
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron\."),
    (r"Apex is not installed", UserWarning, r"megatron\."),
    # megatron-core 0.16's own default (cuda_graph_scope="full") warns in TransformerConfig; no CUDA graphs here.
    (r"full scope is deprecated", UserWarning, r"megatron\."),
    # The distributed optimizer zeroes .grad of its fp32 shard views (`param.view(-1)[range]`, non-leaf by
    # construction; their grads are assigned, never accumulated): megatron marks it "throws grad-access warning".
    (r"The \.grad attribute of a Tensor that is not a leaf", UserWarning, r"megatron\.core\.optimizer\.optimizer"),
    # Called inside megatron-core's collectives, not by megarl.
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning, r""),
)
# vLLM and mlflow set their loggers' levels from these when imported (a user's setting wins).
_LEVEL_VARIABLES = ("VLLM_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL")
_QUIET_LOGGERS = ("megatron", "transformers", "torch.distributed", "urllib3", "httpx")


def quiet_third_party_logs() -> None:
    """Third-party logs at WARNING and the known-harmless warnings filtered; call before importing them."""
    for variable in _LEVEL_VARIABLES:
        os.environ.setdefault(variable, "WARNING")
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for message, category, module in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


class Console:
    """The rank-0 console of a run; on other ranks (or without the console logger) it prints nothing."""

    def __init__(self, enabled: bool, log_freq: int, last_step: int):
        self.enabled, self.log_freq, self.last_step = enabled, log_freq, last_step

    def progress(self, steps: range) -> Iterator[int]:
        """`steps` with a live bar of rate and ETA (a resumed run starts the bar at its first step)."""
        if not self.enabled:
            yield from steps
            return
        # A log file is no terminal: redraw rarely there, so that the bar does not fill it.
        interval = 0.5 if sys.stderr.isatty() else 60.0
        bar = tqdm(initial=steps.start - 1, total=steps.stop - 1, unit="step", dynamic_ncols=True,
                   mininterval=interval)
        try:
            for step in steps:
                yield step
                bar.update()  # after the step; counted here (not by iterating tqdm) so redraws are current
        finally:
            bar.close()

    def ends_period(self, step: int) -> bool:
        """Whether `step` is every `log_freq`-th step or the run's last."""
        return step % self.log_freq == 0 or step == self.last_step

    def show(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        if not self.ends_period(step) and not any(k.startswith("val/") for k in metrics):
            return
        shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
        tqdm.write(f"step {step}: {shown}", file=sys.stdout)
        sys.stdout.flush()

