"""One registry type for everything chosen by name: estimators, losses, scorers, rollout backends.

    ROLLOUT_BACKENDS = Registry("rollout backend")

    @ROLLOUT_BACKENDS.register("vllm")
    class VLLMRollout: ...

A duplicate name fails at import; an unknown name fails listing the registered ones.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._entries))}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)
