"""The RL trainer with and without `actor.offload`/`critic.offload`, in one torchrun world.

Runs the same config twice, offload off then on, three RL steps with a validation after the first
(whose sync the second step reuses) and after the last, with the
real `hf` rollout backend subclassed to record every phase call (create, sleep, wake with tags,
weight update begin/end, generate) and, at each call, the bytes of device storage still held by
the actor's parameters, the rest of the actor, the reference and the critic. A wake-up not preceded
by a release of PyTorch's cached memory (`megarl.device.release_cached_memory`, wrapped here to note
its calls) since the previous phase call is recorded under a name of its own. Prints one REPORT
line (rank 0) with every rank's records, the metric values that differ between the runs and
whether the final weights and optimizer states are bitwise equal.

    torchrun --nproc_per_node=2 offload_checks.py --config configs/quickstart_ppo.yaml key=value ...
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import device
from megarl.distributed import finish_process, init_layout
from megarl.rollout import ROLLOUT_BACKENDS
from megarl.rollout.hf_backend import HFRollout
from megarl.trainer.rl_trainer import RLTrainer
from megarl.trainer.startup import Run, parse_config
from reporting import print_report

ENGINES = []  # the MegatronEngines of the trainer being built: actor, reference, critic
EVENTS = []  # (phase call, resident bytes) of the trainer being run
NOT_COMPARED = ("timing/", "throughput/", "sync/seconds")  # wall-clock times
RELEASES = []  # calls of device.release_cached_memory since the last phase call


def _noting_calls(release_cached_memory):
    def release():
        RELEASES.append(True)
        release_cached_memory()

    return release


device.release_cached_memory = _noting_calls(device.release_cached_memory)


def record(name: str) -> None:
    EVENTS.append((name, resident()))
    RELEASES.clear()


def resident() -> list[int]:
    """Device bytes: [actor parameters, actor gradients + optimizer, reference, critic]."""
    actor, *others = (engine.memory.resident_bytes() for engine in ENGINES)
    return [actor["params"], actor["grads"] + actor["optimizer"], *(sum(other.values()) for other in others)]


@ROLLOUT_BACKENDS.register("recording-hf")
class RecordingHFRollout(HFRollout):
    """The hf backend, recording each phase call and what the trainer holds when it comes."""

    def __init__(self, *args, **kwargs):
        record("create")
        super().__init__(*args, **kwargs)

    def generate(self, prompts, sampling):
        record("generate")
        return super().generate(prompts, sampling)

    def begin_weight_update(self, step, partial=False):
        record("begin_weight_update")
        super().begin_weight_update(step, partial)

    def end_weight_update(self):
        record("end_weight_update")
        super().end_weight_update()

    def sleep(self, keep_weights):
        record("sleep keeping weights" if keep_weights else "sleep")
        super().sleep(keep_weights)

    def wake_up(self, tags):
        record("wake_up " + "+".join(tags) + ("" if RELEASES else " while PyTorch still caches freed memory"))
        super().wake_up(tags)


class ObservedTrainer(RLTrainer):
    def _engine(self, *args, **kwargs):
        engine = super()._engine(*args, **kwargs)
        ENGINES.append(engine)
        return engine


def state_of(trainer: RLTrainer) -> dict[str, list[torch.Tensor]]:
    """Every tensor training continues from: parameters and optimizer state of actor and critic."""
    state = {}
    for name, engine in trainer._trainable().items():
        state[f"{name} params"] = [p.detach().clone() for p in engine.module.parameters()]
        tensors = []
        for optimizer in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
            for group in optimizer.optimizer.param_groups:
                tensors += [p.detach().clone() for p in group["params"]]
            for per_param in optimizer.optimizer.state.values():
                tensors += [v.clone() for v in per_param.values() if isinstance(v, torch.Tensor)]
        state[f"{name} optimizer"] = tensors
    return state


def run(argv: list[str], layout) -> dict:
    ENGINES.clear()
    EVENTS.clear()
    config = parse_config(argv, rl=True)
    trainer = ObservedTrainer(Run(config, layout, Path(config.trainer.output_dir) / config.trainer.experiment_name))
    after_steps, steps, validations = [], [], []
    for step in range(1, config.trainer.total_steps + 1):
        steps.append(trainer.step(step))
        after_steps.append(resident())
        if step in (1, config.trainer.total_steps):
            validations.append(trainer.placement.validate(step))
    return {"events": list(EVENTS), "after_steps": after_steps, "history": steps + validations, "steps": steps,
            "state": state_of(trainer)}


def main() -> None:
    argv = sys.argv[1:]
    layout = init_layout(tp=int(_value(argv, "actor.tp", 1)), pp=int(_value(argv, "actor.pp", 1)), seed=1)
    off = run([*argv, "actor.offload=false", "critic.offload=false"], layout)
    on = run([*argv, "actor.offload=true", "critic.offload=true"], layout)
    compared, differing = 0, []
    for step, (metrics_off, metrics_on) in enumerate(zip(off["history"], on["history"])):
        assert metrics_off.keys() == metrics_on.keys(), (step, metrics_off.keys() ^ metrics_on.keys())
        for key, value in metrics_off.items():
            if not key.startswith(NOT_COMPARED):
                compared += 1
                if not (value == metrics_on[key] or (value != value and metrics_on[key] != metrics_on[key])):
                    differing.append([step, key, value, metrics_on[key]])
    mine = {
        "events_off": off["events"], "events_on": on["events"],
        "after_steps_off": off["after_steps"], "after_steps_on": on["after_steps"],
        "bitwise_equal": {name: len(tensors) > 0 and all(torch.equal(a, b) for a, b in zip(tensors, on["state"][name]))
                          for name, tensors in off["state"].items()},
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        report = {"ranks": everyone, "compared": compared, "differing": differing,
                  "losses": [[h["actor/pg_loss"], h["critic/vf_loss"]] for h in on["steps"]]}
        print_report(report)
    finish_process()


def _value(argv: list[str], key: str, default):
    return next((arg.split("=", 1)[1] for arg in argv if arg.startswith(key + "=")), default)


if __name__ == "__main__":
    main()
