"""Writing a checkpoint where no one can mistake it for a complete one, then publishing it.

    staging = begin(root, step, ["actor", "rng"])     # collective: an empty .global_step_N.partial/
    ... every rank writes its shards into staging ...
    finish(root, step, hf_source, write_small_files)  # collective: rank 0 completes and publishes

Used by the trainer's `Checkpointer` and by `checkpoints_tools/convert_from_hf.py`, so both produce
the same layout (`directory`): the HF config and tokenizer in `hf/`, a manifest written last, one
atomic rename, then `latest`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from megarl.checkpoint.directory import partial_dir, publish, write_manifest
from megarl.models.hf_interop import copy_hf_files


def begin(root: Path, step: int, subdirs: list[str]) -> Path:
    """Collective: rank 0 replaces any leftover staging directory of `step` with an empty one."""
    staging = partial_dir(root, step)
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        for sub in (*subdirs, "hf"):
            (staging / sub).mkdir(parents=True)
    dist.barrier()
    return staging


def finish(root: Path, step: int, hf_source: Path, write_files: Callable[[Path], None] = lambda staging: None) -> Path:
    """Collective, once every rank's shards are written: rank 0 adds the HF files and whatever
    `write_files` writes, then the manifest, and publishes. Returns the published directory."""
    dist.barrier()
    final = root / f"global_step_{step}"
    if dist.get_rank() == 0:
        staging = partial_dir(root, step)
        copy_hf_files(hf_source, staging / "hf")
        write_files(staging)
        write_manifest(staging, step)
        publish(root, step)
    dist.barrier()
    return final
