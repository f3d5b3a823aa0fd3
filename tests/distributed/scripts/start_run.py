"""Start a run under torchrun, write its config as a trainer does, and report the layout each rank joined;
then build the run's actor engine as the RL trainer does, and again for rollout.n = 1, and report whether
each shares prompts."""

import sys
from dataclasses import replace

from megarl.distributed import finish_process
from megarl.engine.megatron_engine import MegatronEngine
from megarl.engine.prompt_sharing import PromptGroups
from megarl.trainer.startup import start_run

run = start_run(sys.argv[1:], rl=True)
run.save_config()
print(f"rank {run.layout.rank}: {run.layout} tp_rank={run.layout.tp_rank} run_dir={run.run_dir}", flush=True)
config = run.config
for n in (config.rollout.n, 1):
    groups = PromptGroups.of_run(replace(config, rollout=replace(config.rollout, n=n)))
    actor = MegatronEngine(run.layout, config.model, config.actor, total_optimizer_steps=1, groups=groups)
    print(f"rank {run.layout.rank}: rollout.n={n} shares prompts: {actor.positioned_rope is not None}", flush=True)
finish_process()
