"""Who runs what, behind one interface (`Placement`): colocated or split (trainer and rollout ranks)."""

from __future__ import annotations

from typing import Sequence

from megarl.config.schema import RunConfig
from megarl.distributed.split_world import SplitWorld
from megarl.engine.megatron_engine import MegatronEngine
from megarl.engine.memory import MemoryPhases
from megarl.generation.engine import EngineSettings
from megarl.generation.inputs import RunInputs
from megarl.generation.policy import RolloutPolicy
from megarl.placement.base import Placement, StepRollouts
from megarl.placement.colocated import ColocatedPlacement
from megarl.placement.split import RolloutWorker, SplitPlacement


def make_placement(config: RunConfig, world: SplitWorld | None, inputs: RunInputs, actor: MegatronEngine,
                   offloading: Sequence[MemoryPhases], needs_greedy_baseline: bool) -> Placement:
    """The trainer's side of `trainer.placement`: colocated (the engines share the trainer's ranks; the models
    of `offloading` leave the device while they generate) or split (`world`: the engines are on ranks of their
    own)."""
    if world is not None:
        return SplitPlacement(world, actor.module, actor.arch, actor.layout, config, inputs)
    policy = RolloutPolicy(actor.module, actor.arch, actor.layout, EngineSettings.of_run(config), offloading,
                           actor.memory, weights_version=lambda: actor.weights_version)
    return ColocatedPlacement(config, inputs, policy, needs_greedy_baseline)


__all__ = ["ColocatedPlacement", "Placement", "RolloutWorker", "SplitPlacement", "StepRollouts", "make_placement"]
