"""Metrics of a run, to the console and to mlflow; only global rank 0 writes.

mlflow receives every step, written in one batch every `log_freq` steps and whenever the trainer
saves a checkpoint (`flush`): each metric row costs SQLite work (about 0.25 ms written alone, half
of it in a batch), which rank 0 would otherwise spend in every step while the other ranks wait. A
killed job loses no step it resumes after: the store holds every step up to its last checkpoint,
and the steps after it run again.

The console (`megarl.tracking.console`) shows a progress bar and a line every `log_freq` steps.
mlflow defaults to a SQLite file in the run directory, an embedded store that needs no server:
`mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db` shows the run. Its artifacts (curves,
config) are kept beside it in `<run_dir>/mlartifacts`; mlflow's own default, `./mlruns` of whatever
directory the job was started from, would scatter them away from the run and mix those of every run
directory (each store numbers its experiment 1). The history of every metric
is also kept in memory for the end-of-run curves (`megarl.trainer.curves`).

A resumed job continues the mlflow run its checkpoint names. When the store does not have that run
(the checkpoint came from another experiment, or `trainer.output_dir` changed since) it logs to a
new run and says so in one warning.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

from megarl.tracking.console import Console

logger = logging.getLogger(__name__)
ARTIFACT_DIR = "mlartifacts"


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _has_run(mlflow, run_id: str) -> bool:
    """Whether the store holds `run_id` (other errors, e.g. an unreachable server, propagate)."""
    from mlflow.exceptions import MlflowException

    try:
        mlflow.get_run(run_id)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return False
    return True


class Tracker:
    def __init__(self, loggers: list[str], run_dir: Path, experiment_name: str, tracking_uri: str, config,
                 is_writer: bool, log_freq: int, last_step: int, run_id: str | None = None):
        """`run_id` continues an earlier mlflow run (a resumed job logs into the same run)."""
        self.loggers = set(loggers) if is_writer else set()
        self.console = Console("console" in self.loggers, log_freq, last_step)
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.unwritten: list = []  # mlflow Metric rows logged since the last flush
        self.run_dir = run_dir
        self._mlflow = None
        self.run_id = None
        if "mlflow" in self.loggers:
            import mlflow

            run_dir.mkdir(parents=True, exist_ok=True)
            store = tracking_uri or f"sqlite:///{run_dir.resolve()}/mlflow.db"
            mlflow.set_tracking_uri(store)
            if not tracking_uri and mlflow.get_experiment_by_name(experiment_name) is None:
                mlflow.create_experiment(experiment_name, (run_dir.resolve() / ARTIFACT_DIR).as_uri())
            mlflow.set_experiment(experiment_name)
            if run_id is not None and not _has_run(mlflow, run_id):
                logger.warning("mlflow run %s, named by the checkpoint, is not in the store %s (a checkpoint of "
                               "another run directory?); logging to a new run", run_id, store)
                run_id = None
            self.run_id = mlflow.start_run(run_id=run_id).info.run_id
            if run_id is None:
                params = flatten(asdict(config) if is_dataclass(config) else dict(config))
                mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
            self._mlflow = mlflow

    def log(self, metrics: dict[str, float], step: int) -> None:
        finite = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        for key, value in finite.items():
            self.history.setdefault(key, []).append((step, value))
        if self._mlflow is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.unwritten += [Metric(k.replace("@", "_at_"), v, now, step) for k, v in finite.items()]
            if self.console.ends_period(step):
                self.flush()
        self.console.show(finite, step)

    def flush(self) -> None:
        """Write the metrics logged since the last flush to mlflow."""
        if self.unwritten:
            self._mlflow.MlflowClient().log_batch(self.run_id, metrics=self.unwritten)
            self.unwritten = []

    def progress(self, steps: range):
        """Iterate the training steps under the console's progress bar (rank 0)."""
        return self.console.progress(steps)

    def log_artifact(self, path: Path) -> None:
        if self._mlflow is not None:
            self._mlflow.log_artifact(str(path))

    def close(self, status: str = "FINISHED") -> None:
        if self._mlflow is not None:
            self.flush()
            self._mlflow.end_run(status=status)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        """Close the run: FINISHED, or FAILED when training stopped on an error (KILLED on Ctrl-C), so that the
        store never shows a dead run as RUNNING."""
        failed = "KILLED" if error_type is not None and issubclass(error_type, KeyboardInterrupt) else "FAILED"
        self.close("FINISHED" if error_type is None else failed)
