"""The mlflow tracker against a real local store: where artifacts go, and resuming a run the store lacks."""

from __future__ import annotations

import logging

import mlflow
import pytest

from megarl.tracking import Tracker


def _tracker(run_dir, run_id=None):
    return Tracker(["mlflow"], run_dir, "exp", "", {"lr": 1.0}, is_writer=True, log_freq=1, last_step=2,
                   run_id=run_id)


def _client(run_dir):
    return mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")


def _runs(run_dir):
    client = _client(run_dir)
    return client.search_runs([client.get_experiment_by_name("exp").experiment_id])


def test_artifacts_are_kept_beside_the_run_not_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    run_dir = tmp_path / "out" / "exp"
    curves = tmp_path / "curves.png"
    curves.write_bytes(b"png")
    tracker = _tracker(run_dir)
    tracker.log_artifact(curves)
    tracker.close()
    assert not (tmp_path / "cwd" / "mlruns").exists()
    [run] = _runs(run_dir)
    stored = run_dir / "mlartifacts"
    assert run.info.artifact_uri == (stored / run.info.run_id / "artifacts").as_uri()
    assert (stored / run.info.run_id / "artifacts" / "curves.png").read_bytes() == b"png"


def test_a_run_id_the_store_lacks_starts_a_new_run_with_one_warning(tmp_path, caplog):
    first = _tracker(tmp_path)
    first.log({"reward/mean": 1.0}, step=1)
    first.close()
    resumed = _tracker(tmp_path, run_id=first.run_id)  # the same store: the same run continues
    resumed.log({"reward/mean": 2.0}, step=2)
    resumed.close()
    assert resumed.run_id == first.run_id and len(_runs(tmp_path)) == 1

    foreign = "0123456789abcdef0123456789abcdef"  # a run of another run directory's store
    with caplog.at_level(logging.WARNING):
        other = _tracker(tmp_path, run_id=foreign)
    other.log({"reward/mean": 3.0}, step=3)
    other.close()
    assert other.run_id not in (foreign, first.run_id) and len(_runs(tmp_path)) == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and foreign in warnings[0].getMessage() and "\n" not in warnings[0].getMessage()
    history = _client(tmp_path).get_metric_history(other.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(3, 3.0)]
    assert _client(tmp_path).get_run(other.run_id).data.params == {"lr": "1.0"}


def test_metrics_reach_the_store_every_log_freq_steps_on_flush_and_at_close(tmp_path):
    tracker = Tracker(["mlflow"], tmp_path, "exp", "", {}, is_writer=True, log_freq=3, last_step=10)

    def stored():
        history = _client(tmp_path).get_metric_history(tracker.run_id, "reward/mean")
        return sorted((m.step, m.value) for m in history)

    for step in (1, 2):
        tracker.log({"reward/mean": float(step)}, step)
    assert stored() == []
    tracker.log({"reward/mean": 3.0}, step=3)
    assert stored() == [(1, 1.0), (2, 2.0), (3, 3.0)]
    tracker.log({"reward/mean": 4.0}, step=4)
    tracker.flush()  # what the trainer does before saving a checkpoint
    assert stored()[-1] == (4, 4.0)
    tracker.log({"reward/mean": 5.0}, step=5)
    tracker.close()
    assert stored() == [(step, float(step)) for step in range(1, 6)]


def test_a_run_that_stops_on_an_error_ends_failed_with_its_metrics(tmp_path):
    with pytest.raises(RuntimeError):
        with _tracker(tmp_path / "failed") as tracker:
            tracker.log({"reward/mean": 0.5}, step=1)
            raise RuntimeError("the reward function broke")
    with _tracker(tmp_path / "finished") as tracker:
        tracker.log({"reward/mean": 0.5}, step=1)
    (failed,), (finished,) = _runs(tmp_path / "failed"), _runs(tmp_path / "finished")
    assert (failed.info.status, finished.info.status) == ("FAILED", "FINISHED")
    assert failed.data.metrics == {"reward/mean": 0.5}
