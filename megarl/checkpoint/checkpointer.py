"""Saving and resuming a run: models and optimizers sharded, everything else small and plain.

    global_step_N/
      actor/, critic/         megatron-core dist checkpoints (model + optimizer): layout-independent,
                              so a run saved at TP2xPP1 resumes at TP1xPP2
      trainer_state.json      step, sampler position, LR schedulers, KL coefficient, mlflow run id
      placement.pt            what the placement resumes from (split placement: the batches generated ahead, or the
                              responses in flight; plain values, loaded with weights_only), rank 0's alone
      rng/rank_<r>.pt         every rank's RNG states (tensors and ints; loaded with weights_only)
      hf/                     the model's config.json and tokenizer, for the conversion tools
      manifest.json           written last (see `directory`)

Every rank writes its own shards (in background processes with `trainer.async_save`); rank 0 writes
the small files and publishes the checkpoint with one atomic rename once all ranks are done. Optimizer
state is saved per model parameter (`optimizer_state`), so it reshards over TP, PP and DP like the model.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import random
import shutil
from multiprocessing.managers import SyncManager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megarl import device
from megarl.checkpoint.directory import (
    CheckpointError,
    complete_checkpoints,
    problem_with,
    remove_oldest,
    step_dirs,
    step_of,
)
from megarl.checkpoint.optimizer_state import (
    check_step_counts,
    initialize_optimizer_state,
    load_optimizer_state,
    sharded_optimizer_state,
)
from megarl.checkpoint.model_loading import load_trained_entries, lora_base_mismatch, trained_entries
from megarl.checkpoint.staging import begin, finish
from megarl.distributed.process import exit_with_parent

logger = logging.getLogger(__name__)


def sharded_state(engine, is_loading: bool) -> dict:
    model = trained_entries(engine.module.sharded_state_dict())
    state = {"model": model}
    if engine.optimizer is not None:
        state["optimizer"] = sharded_optimizer_state(engine.optimizer, model, is_loading)
    return state


def rng_state() -> dict:
    python = random.getstate()
    numpy = np.random.get_state()
    return {
        "python": (python[0], list(python[1]), python[2]),
        "numpy": (numpy[0], torch.from_numpy(numpy[1].astype(np.int64)), numpy[2], numpy[3], numpy[4]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if device.cuda() else [],
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def one_after_another(requests: list[AsyncRequest]) -> AsyncRequest:
    """One asynchronous request that writes the engines' checkpoints in turn.

    Megatron's asynchronous writers report where each tensor landed through one queue per process,
    and each save's finalization (which writes its index) takes the next report from it: two saves
    in flight at once (actor and critic) can take each other's reports and publish an index that
    points at the wrong bytes. Written in turn, the reports arrive in the order the finalizations
    read them. Tensors are staged to host memory now, at the step being saved. The writer process
    dies with the worker that forked it (the processes it forks for its buckets finish their bucket)."""
    staged = []
    for request in requests:
        args = list(request.async_fn_args)
        if request.preload_fn:
            args[1] = request.preload_fn()
        staged.append((request.async_fn, args, request.async_fn_kwargs))

    def write_in_turn():  # in the writer process megatron forks
        exit_with_parent()  # no one publishes what it writes once its worker is dead
        for write, args, kwargs in staged:
            write(*args, **kwargs)

    return AsyncRequest(write_in_turn, (), [fn for request in requests for fn in request.finalize_fns])


def start_writer_results_queue() -> None:
    """Start the queue megatron's shard writers report their results through, in a forked process.

    Megatron starts it on a process's first save, served by a multiprocessing manager it starts with
    the "spawn" method: a new interpreter that imports the launcher's whole `__main__` (torch,
    megatron-core, vLLM, transformers) before it serves, 8 s of every run's first save on a 2-core
    CPU host. A forked manager serves the same queue at once, and dies with this process when it is
    killed (`exit_with_parent`), as a job's processes must."""
    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(initializer=exit_with_parent)
        filesystem_async._results_queue = manager.Queue()


class Checkpointer:
    def __init__(self, root: Path, hf_source: str, config_file: Path, max_to_keep: int, async_save: bool = False):
        self.root, self.hf_source, self.config_file, self.max_to_keep = root, Path(hf_source), config_file, max_to_keep
        self.async_save = async_save
        self.queue = AsyncCallsQueue() if async_save else None

    def find(self, mode: str, path: str) -> Path | None:
        """The checkpoint to resume from: the one `latest` names (auto; where it is damaged, the newest
        complete one before it), none, or `path`. `latest` is the last published save: after a run rolled
        back (`resume_mode=path` to an earlier step), higher steps of the abandoned future remain.

        `disable` refuses a checkpoint directory that already holds an earlier run's checkpoints:
        the new run's saves would mix with them (same step names, retention counting both, `latest`
        moving between runs) and a later auto resume could pick the wrong run."""
        if mode == "disable":
            earlier = step_dirs(self.root)
            if earlier:
                raise CheckpointError(
                    f"trainer.resume_mode=disable, but {self.root} holds an earlier run's checkpoints "
                    f"({', '.join(p.name for p in earlier)}); use trainer.resume_mode=auto to continue that run, "
                    "or another trainer.experiment_name or trainer.checkpoint_dir to start a new one")
            return None
        if mode == "path":
            target = Path(path)
            problem = problem_with(target) if target.is_dir() else "no such directory"
            if problem:
                raise CheckpointError(f"trainer.resume_path={path}: not a usable checkpoint: {problem}")
            return target
        complete = complete_checkpoints(self.root)
        latest = self.root / "latest"
        if latest.is_file():
            published = self.root / latest.read_text().strip()
            if published in complete:
                return published
            logger.warning("latest names %s, which is not a complete checkpoint; resuming from the newest complete "
                           "one before it", published)
            complete = [path for path in complete if step_of(path) < step_of(published)]
        return complete[-1] if complete else None

    def save(self, step: int, engines: dict, trainer_state: dict, placement_state: dict | None = None) -> None:
        """Collective: every rank saves its shards, then rank 0 publishes the checkpoint (with `placement_state`,
        which only rank 0's is written).

        With `async_save`, shards are written by background processes while training goes on and
        the checkpoint is published when they finish (checked at every `poll`); only one save is
        in flight at a time. Everything the checkpoint records is captured now, at `step`."""
        self.wait()
        start_writer_results_queue()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        staging = begin(self.root, step, [*engines, "rng"])
        for name, engine in engines.items():
            check_step_counts(engine.optimizer, engine.scheduler.num_steps, f"saving the {name} at step {step}")
        torch.save(rng_state(), staging / "rng" / f"rank_{rank}.pt")
        state = dict(trainer_state, step=step, world_size=world_size,
                     schedulers={n: e.scheduler.state_dict() for n, e in engines.items()},
                     lora_bases={n: e.base_fingerprint for n, e in engines.items() if e.base_fingerprint})
        requests = [dist_checkpointing.save(sharded_state(engine, is_loading=False), str(staging / name),
                                            async_sharded_save=self.async_save)
                    for name, engine in engines.items()]
        placement_state = placement_state or {}
        if not self.async_save:
            return self._publish(state, placement_state)
        request = one_after_another(requests)
        request.add_finalize_fn(lambda: self._publish(state, placement_state))
        self.queue.schedule_async_request(request)

    def poll(self) -> None:
        """Collective: publish an asynchronous save whose shards are all written."""
        if self.async_save:
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Collective: finish and publish any save in flight (before the next one, and at the end)."""
        if self.async_save:
            self.queue.maybe_finalize_async_calls(blocking=True)

    def _publish(self, state: dict, placement_state: dict) -> None:
        def write_files(staging: Path) -> None:
            (staging / "trainer_state.json").write_text(json.dumps(state, indent=1))
            torch.save(placement_state, staging / "placement.pt")
            shutil.copy(self.config_file, staging / "config.yaml")

        finish(self.root, state["step"], self.hf_source, write_files)
        if dist.get_rank() == 0:
            remove_oldest(self.root, self.max_to_keep)

    @torch.no_grad()
    def load(self, directory: Path, engines: dict) -> dict:
        """Collective: restore models, optimizers, schedulers and RNGs; returns the trainer state, with the placement's
        under "placement" on rank 0 ({} on the others)."""
        if not (directory / "placement.pt").is_file():  # every rank stops, before any collective
            raise CheckpointError(f"{directory}: has no placement.pt (checkpoints saved before 2026-11-27 lack it): "
                                  "resume from a newer checkpoint, or with the megarl that saved this one")
        state = json.loads((directory / "trainer_state.json").read_text())
        state["placement"] = torch.load(directory / "placement.pt", weights_only=True) if dist.get_rank() == 0 else {}
        for name, engine in engines.items():
            if not (directory / name).is_dir():
                raise CheckpointError(f"{directory}: has no {name!r} state; it holds {sorted(state['schedulers'])}")
            mismatch = lora_base_mismatch(name, engine.model_path, state, engine.base_fingerprint)
            if mismatch:
                raise CheckpointError(f"{directory}: {mismatch}")
            initialize_optimizer_state(engine.optimizer)
            loaded = dist_checkpointing.load(sharded_state(engine, is_loading=True), str(directory / name))
            load_trained_entries(engine.module, loaded["model"])
            load_optimizer_state(engine.optimizer, loaded["optimizer"])
            engine.scheduler.load_state_dict(state["schedulers"][name])
            check_step_counts(engine.optimizer, engine.scheduler.num_steps, f"loading {directory / name}")
        if state["world_size"] == dist.get_world_size():  # RNG streams belong to ranks: same-size worlds only
            set_rng_state(torch.load(directory / "rng" / f"rank_{dist.get_rank()}.pt", weights_only=True))
        return state
