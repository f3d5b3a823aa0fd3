"""Wall-clock time per phase of an RL step."""

from __future__ import annotations

import contextlib
import time


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{phase}": seconds for phase, seconds in self.seconds.items()} | {
            "timing/step": sum(self.seconds.values())
        }
