"""Partial rollouts over two engine replicas in lockstep make the batches one engine makes: each replica runs
part of the requests, every rollout rank holds every response once its request ends (and, for a checkpoint, the
tokens of those still running), and (the `hf` engine samples each request alone, from its own seed) the tokens,
log-probs and versions are those of a world of one process; single-turn responses and multi-turn trajectories."""

from __future__ import annotations

import json

import pytest

from megarl.data.synthetic import make_arithmetic
from tests.conftest import ROOT, assert_succeeded, torchrun
from tests.integration import user_environment

SCRIPT = ROOT / "tests/distributed/scripts/partial_replicas.py"


@pytest.mark.parametrize("turns", ["single", "multi"])
def test_two_replicas_make_the_batches_of_one(tiny_models, tmp_path, turns):
    train, _ = make_arithmetic(32, 4, seed=0, out_dir=tmp_path)
    reports = {}
    for processes in (1, 2):
        out = tmp_path / f"world{processes}"
        out.mkdir()
        assert_succeeded(torchrun(processes, SCRIPT, "--model", tiny_models["qwen2-varied-lengths"], "--train", train,
                                  "--out", out, *(user_environment.overrides("AnswerSomeTurns") if turns == "multi"
                                                  else [])))
        reports[processes] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)]
    one, (first, second) = reports[1][0], reports[2]
    assert first["batches"] == second["batches"] == one["batches"]
    assert first["states"] == one["states"]  # the first rollout rank's, which a checkpoint takes
    held = [r for state in one["states"] for g in state["in_flight"] + state["finished"] for r in g["responses"]]
    assert any(r["ids"] and r["finish_reason"] is None for r in held)  # tokens of requests still running
    assert min(first["submits"], second["submits"]) > 0
    assert first["submits"] + second["submits"] == one["submits"]
    spanning = [versions for batch in one["batches"] for versions in batch["versions"]] + [r["versions"] for r in held]
    assert any(len(set(versions)) > 1 for versions in spanning)  # responses begun on one version, ended on another
