"""A PNG of the run's reward, validation score and KL curves, for people who never open mlflow."""

from __future__ import annotations

from pathlib import Path

PANELS = (
    ("reward/mean", "training reward (mean score)"),
    ("val/score/mean", "held-out score"),
    ("actor/kl_loss", "KL to reference"),
    ("mismatch/kl", "rollout vs trainer KL"),
)


def plot_curves(history: dict[str, list[tuple[int, float]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(key, title) for key, title in PANELS if history.get(key)]
    figure, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.5 * max(len(panels), 1), 3.5), squeeze=False)
    for axis, (key, title) in zip(axes[0], panels):
        steps, values = zip(*history[key])
        axis.plot(steps, values, marker="o" if len(steps) < 30 else None)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
