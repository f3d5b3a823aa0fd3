"""Partial rollouts over two engine replicas in lockstep make the batches one engine makes: each replica runs
part of the requests, every rollout rank holds every response, and (the `hf` engine samples each request alone,
from its own seed) the tokens, log-probs and versions are those of a world of one process."""

from __future__ import annotations

import json

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, torchrun

SCRIPT = ROOT / "tests/distributed/scripts/partial_replicas.py"


def test_two_replicas_make_the_batches_of_one(tiny_models, tmp_path):
    train, _ = make_arithmetic(32, 4, seed=0, out_dir=tmp_path)
    reports = {}
    for processes in (1, 2):
        out = tmp_path / f"world{processes}"
        out.mkdir()
        assert_succeeded(torchrun(processes, SCRIPT, "--model", tiny_models["qwen2-varied-lengths"], "--train", train,
                                  "--out", out))
        reports[processes] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)]
    one, (first, second) = reports[1][0], reports[2]
    assert first["batches"] == second["batches"] == one["batches"]
    assert min(first["submits"], second["submits"]) > 0
    assert first["submits"] + second["submits"] == one["submits"]
    assert any(len(set(versions)) > 1 for batch in one["batches"] for versions in batch["versions"])
