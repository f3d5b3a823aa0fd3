"""Every sample of a rollout call draws from a stream of its own, the same however the prompts are split over
engine replicas: the seeds vLLM gives a request's samples (its own `ParentRequest`, on the parameters megarl
builds) never meet another request's."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from vllm.v1.engine.parallel_sampling import ParentRequest

from megarl.rollout.base import Sampling
from megarl.rollout.vllm_backend import _sampling_params


def _sample_seeds(sampling: Sampling, requests: int) -> list[int]:
    seeds = []
    for request in range(requests):
        parent = SimpleNamespace(sampling_params=_sampling_params(sampling, request), cached_child_sampling_params=None)
        seeds += [ParentRequest._get_child_sampling_params(parent, j).seed for j in range(sampling.n)]
    return seeds


def test_each_sample_has_its_own_stream_whatever_the_replicas():
    sampling = Sampling(n=4, seed=1000, max_tokens=8)
    whole = _sample_seeds(sampling, 6)
    assert len(set(whole)) == 6 * 4
    # Two replicas of 3 prompts each, the second's call starting at prompt 3 (as collect_rollouts calls them).
    split = _sample_seeds(sampling, 3) + _sample_seeds(replace(sampling, seed=sampling.seed_of(3)), 3)
    assert split == whole
