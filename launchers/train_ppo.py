"""RL post-training (PPO, GRPO and variants), one identical process per GPU or CPU worker.

    torchrun --nproc_per_node=N launchers/train_ppo.py --config configs/X.yaml [key=value ...]
"""

import sys

from megarl.tracking.console import quiet_third_party_logs

quiet_third_party_logs()  # before the libraries are imported: some warn or log while importing
from megarl.trainer.main import train_ppo  # noqa: E402

if __name__ == "__main__":
    train_ppo(sys.argv[1:])
