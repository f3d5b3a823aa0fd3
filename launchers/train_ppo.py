"""RL post-training (PPO, GRPO and variants), one identical process per GPU or CPU worker.

    torchrun --nproc_per_node=N launchers/train_ppo.py --config configs/X.yaml [key=value ...]
"""

import sys

from megarl.tracking.console import quiet_third_party_logs

quiet_third_party_logs()  # before the libraries are imported: some warn or log while importing
from megarl.distributed import finish_process  # noqa: E402
from megarl.rewards import RewardFunctionError  # noqa: E402
from megarl.trainer.rl_trainer import RLTrainer  # noqa: E402
from megarl.trainer.split import RolloutWorker  # noqa: E402
from megarl.trainer.startup import exit_on_user_error, start_run  # noqa: E402


def main(argv: list[str]) -> None:
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


if __name__ == "__main__":
    main(sys.argv[1:])
