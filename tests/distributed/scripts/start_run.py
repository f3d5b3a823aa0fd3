"""Start a run under torchrun, write its config as a trainer does, and report the layout each rank joined;
then build the run's actor engine as the RL trainer does, again for rollout.n = 1, and once more with 4 sequences
per micro-batch set, and report whether each shares prompts and the micro-batches it cuts a GRPO share into:
two prompts of 30 tokens, each with 8 responses of 2-4 tokens."""

import sys
from dataclasses import replace

import torch

from megarl.distributed import finish_process
from megarl.engine.batch import SequenceBatch
from megarl.engine.megatron_engine import MegatronEngine
from megarl.engine.prompt_sharing import PromptGroups
from megarl.trainer.startup import start_run
from reporting import write_line

PROMPT = 30
RESPONSES = [4] * 8 + [2, 3, 4, 2, 3, 4, 2, 3]


def report(line: str) -> None:
    write_line(f"rank {run.layout.rank}: {line}")


run = start_run(sys.argv[1:], rl=True)
run.save_config()
report(f"{run.layout} tp_rank={run.layout.tp_rank} run_dir={run.run_dir}")
config = run.config
tokens = torch.randint(5, 100, (len(RESPONSES), PROMPT + max(RESPONSES)), generator=torch.Generator().manual_seed(0))
tokens[1:8, :PROMPT], tokens[9:, :PROMPT] = tokens[0, :PROMPT], tokens[8, :PROMPT]
share = SequenceBatch(tokens, torch.full((len(RESPONSES),), PROMPT), torch.tensor(RESPONSES))
for n, micro_batch_size in ((config.rollout.n, 0), (1, 0), (1, 4)):
    groups = PromptGroups.of_run(replace(config, rollout=replace(config.rollout, n=n)))
    engine = replace(config.actor, micro_batch_size_per_rank=micro_batch_size)
    actor = MegatronEngine(run.layout, config.model, engine, total_optimizer_steps=1, groups=groups)
    case = f"rollout.n={n}" + (f" micro_batch_size_per_rank={micro_batch_size}" if micro_batch_size else "")
    report(f"{case} shares prompts: {actor.positioned_rope is not None}")
    report(f"{case} micro-batches: {actor._micro_batches(share)}")
finish_process()
