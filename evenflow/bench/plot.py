"""The four curves of the token budget in one PNG: TTFT, ITL, throughput, utilization."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class CurvePoint:
    """One budget's numbers, in the units the plot shows (ms, tokens/s, tokens/step, fraction)."""

    label: str  # "256", "unchunked" or "target 30 ms"
    adaptive: bool  # --target-itl-ms: drawn as stars, not joined to the fixed budgets' curve
    ttft_p50: float
    ttft_p99: float
    itl_p99: float
    itl_max: float
    total_throughput: float
    output_throughput: float
    tokens_per_step: float | None
    busy_fraction: float | None
    capacity: float | None = None
    default: bool = False  # the engine run with no budget flag: drawn as a large diamond, labelled


def plot_budget_curves(points: list[CurvePoint], title: str, ttft_of: str, itl_of: str, out: Path) -> None:
    """Write a 2x2 figure (a 5th panel with capacity when measured) to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_capacity = any(p.capacity is not None for p in points)
    ncols = 3 if with_capacity else 2
    fig, axes = plt.subplots(2, ncols, figsize=(5.2 * ncols, 8), squeeze=False)
    x = list(range(len(points)))
    labels = [p.label for p in points]

    def panel(ax, series, ylabel: str, title_text: str, log: bool = False) -> None:  # type: ignore[no-untyped-def]
        for name, ys, style in series:
            fixed = [(xi, y) for xi, y, p in zip(x, ys, points) if y is not None and not p.adaptive and not p.default]
            adaptive = [(xi, y) for xi, y, p in zip(x, ys, points) if y is not None and p.adaptive]
            default = [(xi, y) for xi, y, p in zip(x, ys, points) if y is not None and p.default]
            color = None
            if fixed:
                color = ax.plot([f[0] for f in fixed], [f[1] for f in fixed], style, label=name)[0].get_color()
            if adaptive:
                ax.plot([a[0] for a in adaptive], [a[1] for a in adaptive], "*", markersize=13, color=color,
                        label=None if fixed else name)
            for xi, y in default:
                ax.plot([xi], [y], "D", markersize=11, color=color, markeredgecolor="red", markeredgewidth=2)
                ax.annotate("default", (xi, y), textcoords="offset points", xytext=(6, 6), color="red", fontsize=8)
        ax.set_xticks(x, labels, rotation=45)
        ax.set_xlabel("max_num_batched_tokens (stars: --target-itl-ms; red diamond: no flag)")
        ax.set_ylabel(ylabel)
        ax.set_title(title_text)
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not exposed by this server", ha="center", va="center", transform=ax.transAxes)

    panel(axes[0][0], [("p50", [p.ttft_p50 for p in points], "o-"), ("p99", [p.ttft_p99 for p in points], "s-")],
          "ms", f"TTFT ({ttft_of})", log=True)
    panel(axes[0][1], [("p99", [p.itl_p99 for p in points], "o-"), ("max", [p.itl_max for p in points], "s--")],
          "ms", f"ITL ({itl_of})", log=True)
    panel(axes[1][0], [("total", [p.total_throughput for p in points], "o-"),
                       ("output", [p.output_throughput for p in points], "s-")], "tokens / s", "throughput")
    util = axes[1][1]
    panel(util, [("tokens per step", [p.tokens_per_step for p in points], "o-")], "tokens / step",
          "utilization (engine's /metrics)")
    if any(p.busy_fraction is not None for p in points):
        twin = util.twinx()
        busy = [(xi, p.busy_fraction) for xi, p in zip(x, points) if p.busy_fraction is not None]
        twin.plot([b[0] for b in busy], [b[1] for b in busy], "r^--", label="model busy fraction")
        twin.set_ylabel("busy fraction")
        twin.set_ylim(0, 1.05)
        twin.legend(loc="lower right")
    if with_capacity:
        panel(axes[0][2], [("capacity", [p.capacity for p in points], "o-")], "requests / s",
              "capacity under the P99 SLOs")
        axes[1][2].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
