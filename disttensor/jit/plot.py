"""A picture of an arena plan (matplotlib, an optional extra: ``pip install disttensor[plot]``)."""
from __future__ import annotations

from typing import Sequence

from .memory import ArenaPlan, Buffer, live_bytes

__all__ = ["plot_arena"]


def plot_arena(buffers: Sequence[Buffer], plan: ArenaPlan, path: str, title: str = "") -> None:
    """Save to ``path`` one rectangle per buffer (x: its live instructions, y: its bytes in the
    arena) and the bytes live at each instruction (the lower-bound curve) over them."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError as e:
        raise ImportError("plot_memory needs matplotlib: pip install 'disttensor[plot]'") from e
    live = live_bytes(buffers) or [0]
    n = len(live)
    scale, unit = (2**20, "MiB") if plan.size >= 2**20 else (2**10, "KiB")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    cmap = plt.get_cmap("tab20")
    for k, b in enumerate(buffers):
        ax.add_patch(Rectangle((b.first - 0.5, plan.offsets[b.id] / scale), b.last - b.first + 1,
                               b.size / scale, facecolor=cmap(k % 20), edgecolor="black",
                               linewidth=0.3, alpha=0.85))
    xs = [x for k in range(n) for x in (k - 0.5, k + 0.5)]
    ax.plot(xs, [live[k] / scale for k in range(n) for _ in (0, 1)], color="black",
            linewidth=1.2, label=f"bytes live (lower bound {plan.lower_bound / scale:.2f} {unit})")
    ax.axhline(plan.size / scale, color="red", linestyle="--", linewidth=1,
               label=f"arena {plan.size / scale:.2f} {unit} ({plan.strategy})")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylim(0, max(plan.size, 1) / scale * 1.08)
    ax.set_xlabel("instruction")
    ax.set_ylabel(f"offset ({unit})")
    ax.set_title(title or "arena plan")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
