"""Process-wide settings, applied at one named point: `configure_process()`.

Some settings change the whole process rather than one object, so they are made explicitly, once,
before any model, engine or checkpoint exists, instead of on import or in a constructor:

- megatron-core's CPU compatibility layer (`cpu_compat`), where `megarl.device` says CUDA is absent;
- vLLM's environment for an engine colocated in this process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`
  (the engine lives in this process, not in a child) and `VLLM_DIST_IDENT` (names vLLM's CPU
  shared-memory segments; unique per job, from its rendezvous port, so jobs on one host never clash);
- torch's checkpoint-metadata reads go through the restricted unpickler (`safe_metadata`).

`init_process_group` calls it: every megarl program (launchers, tools, benchmarks, the tests' worker
scripts) joins its torchrun world through it. Settings the user already made in the environment win.
"""

from __future__ import annotations

import os

from megarl.distributed import safe_metadata
from megarl.distributed.cpu_compat import apply_cpu_compat


def configure_process() -> None:
    """Apply every process-wide setting (idempotent). Needs MASTER_PORT set (torchrun's rendezvous)."""
    apply_cpu_compat()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_DIST_IDENT", f"megarl{os.environ['MASTER_PORT']}")
    safe_metadata.install()
