"""Wall-clock time per phase of an RL step and of the whole step (phases and what runs between
them: sharing the batch, reducing the metrics); an error raised inside a phase (a collective that timed
out, say) carries a note naming the phase, and the start of each phase is logged at debug level
(`MEGARL_LOG_LEVEL=DEBUG` shows where a job is, or was when it died)."""

from __future__ import annotations

import contextlib
import logging
import time

logger = logging.getLogger(__name__)


class PhaseTimer:
    def __init__(self, step: int):
        self.step = step
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the step began."""
        return time.perf_counter() - self.started

    @contextlib.contextmanager
    def __call__(self, phase: str):
        logger.debug("step %d: %s phase begins", self.step, phase)
        start = time.perf_counter()
        try:
            yield
        except BaseException as error:
            error.add_note(f"megarl: raised during the '{phase}' phase of the RL step")
            raise
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{phase}": seconds for phase, seconds in self.seconds.items()} | {"timing/step": self.elapsed()}
