"""What a run prints: a progress bar of the steps, a metrics line now and then, little else.

Rank 0 shows one tqdm bar (rate and ETA) and writes metric lines above it with `tqdm.write`, so the
two never overwrite each other. A line is printed every `trainer.log_freq` steps, at the last step
and whenever validation metrics are present; mlflow still receives every step (see `Tracker`).

`quiet_third_party_logs` is called by the launchers before the libraries are imported: their INFO
logs go, and the warnings and logged notices that fire on every CPU run for a known, harmless reason
are filtered, each with the reason next to it. Anything else they warn about still shows (one C++
notice cannot be filtered from Python: vLLM's CPU worker's "NUMA binding: Using MEMBIND policy").
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
                "actor/moe/load_balancing_loss", "actor/moe/z_loss", "actor/moe/routing_agreement", "agent/turns",
                "agent/tool_call_share", "timing/step",
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
    # vLLM's Triton dispatcher looks up every attribute of torch.distributed, a deprecated alias among them.
    (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, r"vllm\."),
)
# (logger, message start): notices logged once a process at every start of a vLLM engine on CPU, for the reason given.
_KNOWN_NOTICES = (
    # megarl names vLLM's CPU shared-memory segments per job with it (`megarl.distributed.process`): vLLM's CPU
    # worker reads the variable, but vLLM's list of variables lacks it.
    ("vllm.platforms.interface", "Unknown vLLM environment variable detected: VLLM_DIST_IDENT"),
    # The engine lives in the trainer's process, which gets its RNG states back (`megarl.rollout.vllm_backend`).
    ("vllm.engine.arg_utils", "The global random seed is set to"),
    # megarl turns chunked prefill off on CPU for its seeded requests (`megarl.rollout.vllm_backend.whole_prefills`);
    # the engine's tokens and log-probs are tested against transformers' with it off.
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill"),
    # megarl runs vLLM eagerly on CPU (`megarl.rollout.vllm_backend`).
    ("vllm.config.vllm", "Enforce eager set"),
    ("vllm.config.vllm", "Inductor compilation was disabled"),
    # vLLM's CPU build has no Triton: it runs its V1 model runner and its C++ kernels.
    ("vllm.platforms.cpu", "Triton is not installed"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),
    ("torch._library.triton", "Triton not available"),
    # About the state of Mamba layers, which megarl's models do not have.
    ("vllm.platforms.cpu", "Reset SSM cache type"),
    # The CPU worker swaps `torch.set_num_threads` for this warning, then calls it itself; megarl gives it back
    # once the engine is built, and the count kept is the one OMP_NUM_THREADS asked for.
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`"),
    # Advice for serving on CPU (tcmalloc and Intel's OpenMP preloaded); megarl's CPU runs are for development.
    ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD"),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD"),
)
# vLLM and mlflow set their loggers' levels from these when imported (a user's setting wins).
_LEVEL_VARIABLES = ("VLLM_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL")
_QUIET_LOGGERS = ("megatron", "transformers", "torch.distributed", "urllib3", "httpx")


class _KnownNotices(logging.Filter):
    """Drops a logger's records that start with one of `starts`."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_third_party_logs() -> None:
    """Third-party logs at WARNING and the known-harmless warnings and notices filtered; call before
    importing them (idempotent)."""
    for variable in _LEVEL_VARIABLES:
        os.environ.setdefault(variable, "WARNING")
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for message, category, module in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name in {logger for logger, _ in _KNOWN_NOTICES}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownNotices) for f in logger.filters):
            logger.addFilter(_KnownNotices(tuple(text for owner, text in _KNOWN_NOTICES if owner == name)))


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

