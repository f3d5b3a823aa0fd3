"""The teacher of on-policy distillation (`algorithm.adv_estimator=opd`, `megarl.algorithms.distillation`).

The teacher is a frozen megatron-core model loaded from `teacher.path` that scores the student's
rollouts (forward only, at the rollout temperature, like the reference model). It may differ from the
student in size but must share its tokenizer, because it scores the student's token ids: that is
checked at start-up, before any model is built (`megarl.trainer.startup.check_shared_tokenizers`).

It runs on the actor's parallel layout: megatron-core keeps one TP/PP layout per process
(`parallel_state`), and megarl's loader, log-prob kernel and pipeline schedule all read it. It
follows `actor.offload` between uses, as the reference does.
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.algorithms import reverse_kl_tokens
from megarl.config.schema import ActorConfig
from megarl.trainer.metrics import ShareStats


def teacher_engine_config(actor: ActorConfig, micro_batch_size_per_rank: int) -> ActorConfig:
    """The actor's engine settings (batching, offload, log-prob chunks) with the teacher's micro-batch size."""
    return dataclasses.replace(actor, micro_batch_size_per_rank=micro_batch_size_per_rank
                               or actor.micro_batch_size_per_rank)


def distillation_stats(stats: ShareStats, student_logprobs_BR: torch.Tensor, teacher_logprobs_BR: torch.Tensor,
                       mask_BR: torch.Tensor) -> None:
    """`teacher/reverse_kl`: the mean over response tokens of log pi_s - log pi_T, an estimate of the
    per-token KL(student || teacher) on the student's samples; `teacher/logprob_mean`: the teacher's
    mean log-prob of those tokens."""
    valid = mask_BR > 0
    stats.add_mean("teacher/reverse_kl", reverse_kl_tokens(student_logprobs_BR, teacher_logprobs_BR, mask_BR)[valid])
    stats.add_mean("teacher/logprob_mean", teacher_logprobs_BR[valid])
