"""Start a run under torchrun, write its config as a trainer does, and report the layout each rank joined."""

import sys

from megarl.distributed import finish_process
from megarl.trainer.startup import start_run

run = start_run(sys.argv[1:], rl=True)
run.save_config()
print(f"rank {run.layout.rank}: {run.layout} tp_rank={run.layout.tp_rank} run_dir={run.run_dir}", flush=True)
finish_process()
