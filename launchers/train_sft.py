"""Supervised fine-tuning (a warm start for RL) on the RL data layout; exports <run_dir>/hf.

    torchrun --nproc_per_node=N launchers/train_sft.py --config configs/X.yaml [key=value ...]
"""

import sys

from megarl.trainer.sft import SFTTrainer
from megarl.trainer.startup import start_run


def main(argv: list[str]) -> None:
    try:
        trainer = SFTTrainer(start_run(argv, rl=False))
    except ValueError as error:  # config and data errors: one line naming the key, file or row
        sys.exit(f"megarl: {error}")
    trainer.fit()


if __name__ == "__main__":
    main(sys.argv[1:])
