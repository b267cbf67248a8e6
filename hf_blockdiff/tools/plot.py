"""`hf-blockdiff demo --sweep --plot PATH`: accuracy against tokens per forward, one point per setting, the Pareto
front marked (matplotlib: `pip install "hf-blockdiff[plot]"`)."""

from __future__ import annotations

from .sweep import STEPS, SweepRow


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError('--plot needs matplotlib: pip install "hf-blockdiff[plot]"') from None
    return plt


def _group(row: SweepRow) -> str:
    if row.setting.mode != "single-block":
        return row.setting.mode
    return "fixed count per step" if row.setting.parameter == STEPS else "threshold rules"


def _point(row: SweepRow) -> tuple[float, float]:
    return row.greedy.tokens_per_forward, 100 * row.greedy.accuracy


def plot_sweep(rows: list[SweepRow], path: str, title: str) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(11, 7), dpi=110)
    for group, marker in zip(dict.fromkeys(map(_group, rows)), "osD^v"):
        x, y = zip(*(_point(row) for row in rows if _group(row) == group))
        axes.scatter(x, y, marker=marker, s=36, alpha=0.8, label=group)
    front: dict[tuple[float, float], list[str]] = {}  # settings that land on the same point share one label
    for row in sorted((row for row in rows if row.on_front), key=_point):
        front.setdefault(_point(row), []).append(row.setting.label)
    axes.plot([x for x, _ in front], [y for _, y in front], "k--", lw=1, label="Pareto front")
    right = max(x for x, _ in map(_point, rows))
    for (x, y), labels in front.items():
        left = x > 0.6 * right  # labels of the right-hand points run leftwards, inside the axes
        axes.annotate("\n".join(labels), (x, y), fontsize=7, xytext=(-6 if left else 6, -4), va="top",
                      ha="right" if left else "left", textcoords="offset points")
    axes.set_xlabel("tokens per forward (greedy)")
    axes.set_ylabel("held-out accuracy, greedy (%)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
