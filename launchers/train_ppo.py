"""RL post-training (PPO, GRPO and variants), one identical process per GPU or CPU worker.

    torchrun --nproc_per_node=N launchers/train_ppo.py --config configs/X.yaml [key=value ...]
"""

import sys

from megarl.tracking.console import quiet_third_party_logs

quiet_third_party_logs()  # before the libraries are imported: some warn or log while importing
from megarl.trainer.rl_trainer import RLTrainer  # noqa: E402
from megarl.trainer.startup import start_run  # noqa: E402


def main(argv: list[str]) -> None:
    try:
        trainer = RLTrainer(start_run(argv, rl=True))
    except ValueError as error:  # config and data errors: one line naming the key, file or row
        sys.exit(f"megarl: {error}")
    trainer.fit()


if __name__ == "__main__":
    main(sys.argv[1:])
