"""The teacher of on-policy distillation (`algorithm.adv_estimator=opd`, `megarl.algorithms.distillation`).

The teacher is a frozen megatron-core model loaded from `teacher.path` that scores the student's
rollouts (forward only, at the rollout temperature, like the reference model). It may differ from the
student in size but must share its tokenizer, because it scores the student's token ids: that is
checked at start-up, before any model is built.

It runs on the actor's parallel layout: megatron-core keeps one TP/PP layout per process
(`parallel_state`), and megarl's loader, log-prob kernel and pipeline schedule all read it. It
follows `actor.offload` between uses, as the reference does.
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.algorithms import reverse_kl_tokens
from megarl.config import ConfigError, RunConfig
from megarl.config.schema import ActorConfig
from megarl.trainer.metrics import ShareStats

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def check_shared_tokenizer(config: RunConfig) -> None:
    """The teacher shares the student's tokenizer (a one-line `ConfigError` naming both paths)."""
    teacher = config.teacher
    difference = tokenizer_difference(config.model.path, teacher.path)
    if difference:
        raise ConfigError(f"teacher.path={teacher.path!r} and model.path={config.model.path!r} have different "
                          f"tokenizers ({difference}); the teacher scores the student's token ids, so they must "
                          "share one tokenizer")


def tokenizer_difference(student_path: str, teacher_path: str) -> str | None:
    """The first way the two directories' tokenizers differ, as a user would check it: the same
    token -> id vocabulary (added tokens included) and the same special tokens; None if they agree."""
    from transformers import AutoTokenizer

    student, teacher = AutoTokenizer.from_pretrained(student_path), AutoTokenizer.from_pretrained(teacher_path)
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        only_student = sorted(set(student_vocab) - set(teacher_vocab))
        only_teacher = sorted(set(teacher_vocab) - set(student_vocab))
        if only_student or only_teacher:
            token, owner = (only_student[0], "student") if only_student else (only_teacher[0], "teacher")
            return (f"vocabularies of {len(student_vocab)} and {len(teacher_vocab)} tokens; e.g. {token!r} only in "
                    f"the {owner}'s")
        token = next(t for t in sorted(student_vocab) if student_vocab[t] != teacher_vocab[t])
        return (f"token {token!r} has id {student_vocab[token]} in the student's and {teacher_vocab[token]} "
                "in the teacher's")
    for name in SPECIAL_TOKENS:
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(student, name)!r} in the student's, {getattr(teacher, name)!r} in the teacher's"
    return None


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
