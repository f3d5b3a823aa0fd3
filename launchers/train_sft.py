"""Supervised fine-tuning (a warm start for RL) on the RL data layout; exports <run_dir>/hf.

    torchrun --nproc_per_node=N launchers/train_sft.py --config configs/X.yaml [key=value ...]
"""

import sys

from megarl.tracking.console import quiet_third_party_logs

quiet_third_party_logs()  # before the libraries are imported: some warn or log while importing
from megarl.distributed import finish_process  # noqa: E402
from megarl.trainer.sft import SFTTrainer  # noqa: E402
from megarl.trainer.startup import exit_on_user_error, start_run  # noqa: E402


def main(argv: list[str]) -> None:
    try:
        trainer = SFTTrainer(start_run(argv, rl=False))
    except ValueError as error:  # config and data errors: one line naming the key, file or row
        exit_on_user_error(error)
    trainer.fit()
    finish_process()


if __name__ == "__main__":
    main(sys.argv[1:])
