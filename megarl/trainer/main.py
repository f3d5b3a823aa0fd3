"""The launchers' entry points: what every rank of a torchrun job runs for an RL run or an SFT run.

    python launchers/train_ppo.py ...   ->  train_ppo(argv)
    python launchers/train_sft.py ...   ->  train_sft(argv)
"""

from __future__ import annotations

from megarl.distributed import finish_process
from megarl.messages import exit_on_user_error
from megarl.placement import RolloutWorker
from megarl.rewards import RewardFunctionError
from megarl.trainer.rl_trainer import RLTrainer
from megarl.trainer.sft import SFTTrainer
from megarl.trainer.startup import start_run


def train_ppo(argv: list[str]) -> None:
    """The RL trainer on the training ranks; under split placement, the rollout ranks' generator on the others."""
    try:
        run = start_run(argv, rl=True)
        program = RolloutWorker(run.config, run.world) if run.is_rollout_rank else RLTrainer(run)
    except ValueError as error:  # config and data errors: one line naming the key, file or row
        exit_on_user_error(error)
    try:
        program.fit()
    except RewardFunctionError as error:  # every reward call of a step failed: one line with the first failure
        exit_on_user_error(error)
    finish_process()


def train_sft(argv: list[str]) -> None:
    try:
        trainer = SFTTrainer(start_run(argv, rl=False))
    except ValueError as error:  # config and data errors: one line naming the key, file or row
        exit_on_user_error(error)
    trainer.fit()
    finish_process()
