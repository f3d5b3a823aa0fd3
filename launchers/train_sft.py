"""Supervised fine-tuning (a warm start for RL) on the RL data layout; exports <run_dir>/hf.

    torchrun --nproc_per_node=N launchers/train_sft.py --config configs/X.yaml [key=value ...]
"""

import sys

from megarl.tracking.console import quiet_third_party_logs

quiet_third_party_logs()  # before the libraries are imported: some warn or log while importing
from megarl.trainer.main import train_sft  # noqa: E402

if __name__ == "__main__":
    train_sft(sys.argv[1:])
