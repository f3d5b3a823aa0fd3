"""Phase timing and the note that names the phase an error (e.g. a timed-out collective) came from."""

from __future__ import annotations

import time

import pytest

from megarl.tracking.timing import PhaseTimer


def test_phases_are_timed_and_the_step_includes_what_runs_between_them():
    timer = PhaseTimer(step=1)
    with timer("rollout"):
        time.sleep(0.02)
    time.sleep(0.03)  # between phases
    with timer("update_actor"):
        pass
    metrics = timer.metrics()
    assert metrics["timing/rollout"] >= 0.02
    assert metrics["timing/step"] >= metrics["timing/rollout"] + metrics["timing/update_actor"] + 0.03


def test_an_error_names_its_phase():
    timer = PhaseTimer(step=1)
    with pytest.raises(RuntimeError) as error:
        with timer("reshard"):
            raise RuntimeError("[gloo] Timed out waiting 1800000ms for recv operation to complete")
    assert "raised during the 'reshard' phase" in "".join(error.value.__notes__)
