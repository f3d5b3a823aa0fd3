"""A real 2-process start-up: both ranks join TP2, rank 0 writes the resolved config; the actor engine built
for a config without tuning keys shares prompts, at rollout.n = 1 it does not and says why once, and it cuts
a GRPO share into micro-batches under a token budget."""

from __future__ import annotations

import ast

from megarl.config import load_config
from tests.conftest import ROOT, assert_succeeded, torchrun

PROMPT_AND_RESPONSES = [30 + r for r in [4] * 8 + [2, 3, 4, 2, 3, 4, 2, 3]]


def test_start_run_joins_layout_and_writes_resolved_config(tiny_models, tmp_path):
    model = tiny_models["qwen2-tied"]
    result = torchrun(2, ROOT / "tests/distributed/scripts/start_run.py", "--config", "configs/tiny_cpu.yaml",
                      f"model.path={model}", "actor.tp=2", f"trainer.output_dir={tmp_path}", "trainer.seed=7")
    assert_succeeded(result)
    assert "rank 0: TP2xPP1xDP1 tp_rank=0" in result.stdout and "rank 1: TP2xPP1xDP1 tp_rank=1" in result.stdout
    written = load_config(str(tmp_path / "tiny_cpu" / "config.yaml"))
    assert (written.actor.tp, written.trainer.seed, written.model.path) == (2, 7, str(model))


def test_actor_of_a_config_without_tuning_keys_shares_prompts_and_not_at_one_sample(tiny_models, tmp_path):
    """configs/tiny_cpu.yaml sets no engine key: rollout.n = 8 repeats each 128-token prompt 8 times and
    the tiny dense model (h128, 4 heads of 32, 2 KV heads, ffn 384) on the local layers shares them: one row
    of 128 + 8 x 64 tokens, 640 x 196,608 + 640^2 x 256 = 231M multiply-adds a layer, against 8 rows of 192,
    8 x (192 x 196,608 + 192^2 x 256) = 377M. One sample per prompt repeats none: off, with the reason on
    one line, from rank 0 alone (once for each of the two engines built at rollout.n = 1).

    Its micro-batches take the default token budget: 4 x the share's longest sequence, 4 x (30 + 4) = 136
    tokens, or what 1 GiB of activations holds where that is more. The share (two 30-token prompts, 8 responses
    each: all of 4 tokens, then 2-4) keeps about (8 x 128 + 4 x 128 + 2 x 64 + 4 x 34 + 5 x 384) x 4 layers x
    4 bytes + 101 x 4 bytes of logits = 59,924 bytes a token not shared (17,918 tokens in 1 GiB), 61,716
    shared (rows of 30 + 32 = 62 tokens and 30 + 23: 17,398): one micro-batch either way. With
    micro_batch_size_per_rank = 4 set, the budget is 136 tokens: the 16 unshared sequences of 32-34 tokens,
    at most 4 in one (136 / 34, 136 / 33 and 136 / 32 all round down to 4), make four micro-batches."""
    result = torchrun(2, ROOT / "tests/distributed/scripts/start_run.py", "--config", "configs/tiny_cpu.yaml",
                      f"model.path={tiny_models['qwen2-tied']}", "actor.tp=2", f"trainer.output_dir={tmp_path}")
    assert_succeeded(result)
    for rank in (0, 1):
        assert f"rank {rank}: rollout.n=8 shares prompts: True" in result.stdout
        assert f"rank {rank}: rollout.n=1 shares prompts: False" in result.stdout
        for n in (8, 1):
            assert f"rank {rank}: rollout.n={n} micro-batches: [{list(range(16))}]" in result.stdout
        set_size = ast.literal_eval(next(line for line in result.stdout.splitlines() if line.startswith(
            f"rank {rank}: rollout.n=1 micro_batch_size_per_rank=4 micro-batches: ")).split(": ", 2)[2])
        assert sorted(i for micro in set_size for i in micro) == list(range(16)) and len(set_size) == 4
        assert all(len(micro) * max(PROMPT_AND_RESPONSES[i] for i in micro) <= 136 for micro in set_size)
    notices = [line for line in result.stderr.splitlines() if "prompt sharing off" in line]
    assert len(notices) == 2 and all(notice.endswith("rollout.n = 1: no prompt repeats") for notice in notices)
