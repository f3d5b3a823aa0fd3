"""Metric sinks: console and mlflow (a local SQLite store by default)."""

from megarl.tracking.tracker import Tracker

__all__ = ["Tracker"]
