"""Gantt charts of predicted iterations: one row per resource, one bar per tensor step.

The chosen strategy is drawn above the fp32 baseline on the same time axis; the forward pass
and backward segments sit on the GPU row under the GPU compression tasks; iteration times
are annotated. Rendering uses matplotlib's Agg backend (no display needed).

Example:
    >>> strategy, timelines = plan_with_timelines(wl, cluster, "randomk", {"ratio": 0.01})
    >>> draw_timelines(timelines, "timeline.png", title=wl.model)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from byteps_espresso.strategy.costs import RESOURCES
from byteps_espresso.strategy.timeline import Timeline

__all__ = ["KIND_COLORS", "draw_timelines", "supported_formats"]

# One colour per step kind (compression steps warm, dense collectives blue, compressed ones
# green, PS purple); forward/backward grey.
KIND_COLORS = {
    "forward": "#bdbdbd", "backward": "#d9d9d9",
    "Comp": "#e6550d", "Decomp": "#fdae6b",
    "Allreduce": "#3182bd", "ReduceScatter": "#6baed6", "Allgather": "#9ecae1",
    "Reduce": "#08519c", "Broadcast": "#c6dbef",
    "AllgatherC": "#31a354", "AlltoallC": "#74c476", "GatherC": "#006d2c",
    "BroadcastC": "#a1d99b",
    "PushPull": "#756bb1", "PushPullC": "#9e9ac8",
}


def supported_formats() -> set[str]:
    """Image file extensions the Agg backend writes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return set(FigureCanvasAgg(Figure()).get_supported_filetypes())


def _draw_one(ax, tl: Timeline, label: str) -> set[str]:  # type: ignore[no-untyped-def]
    rows = {name: len(RESOURCES) - 1 - i for i, name in enumerate(RESOURCES)}
    used = {"forward", "backward"}
    f = tl.forward_us / 1e3
    gpu = rows["gpu"]
    ax.broken_barh([(0, f)], (gpu - 0.4, 0.8), color=KIND_COLORS["forward"])
    prev = 0.0
    for r in tl.ready_us:
        ax.broken_barh([(f + prev / 1e3, (r - prev) / 1e3)], (gpu - 0.4, 0.8),
                       color=KIND_COLORS["backward"], edgecolor="white", linewidth=0.3)
        prev = r
    for task in tl.tasks:
        if task.end_us <= task.start_us:
            continue
        kind = tl.options[task.tensor].steps[task.step].kind.value
        used.add(kind)
        ax.broken_barh([(f + task.start_us / 1e3, (task.end_us - task.start_us) / 1e3)],
                       (rows[task.resource] - 0.35, 0.7), color=KIND_COLORS[kind],
                       edgecolor="black", linewidth=0.2)
    end = tl.iteration_us / 1e3
    ax.axvline(end, color="black", linestyle="--", linewidth=0.8)
    ax.text(end, len(RESOURCES) - 0.4, f" {end:.1f} ms", va="bottom", ha="left", fontsize=8)
    ax.set_yticks([rows[n] for n in RESOURCES], list(RESOURCES))
    ax.set_ylim(-0.6, len(RESOURCES) - 0.2)
    ax.set_title(f"{label}: iteration {end:.1f} ms", fontsize=9, loc="left")
    return used


def draw_timelines(timelines: Mapping[str, Timeline], path: str | os.PathLike[str],
                   title: str = "", metadata: Mapping[str, str] | None = None) -> None:
    """Draw each timeline (e.g. {"chosen": ..., "fp32": ...}) as a panel, top to bottom.

    The figure is written to ``path`` through a temporary file and a rename. ``metadata``
    (PNG only) is stored as text chunks, e.g. what the picture was drawn from.

    Raises:
        ValueError: no timelines, or an image format matplotlib cannot write.
    """
    if not timelines:
        raise ValueError("nothing to draw: no timelines")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    target = os.fspath(path)
    ext = os.path.splitext(target)[1].lstrip(".").lower() or "png"
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 2.2 * len(timelines) + 0.8),
                             sharex=True, squeeze=False)
    used: set[str] = set()
    for ax, (label, tl) in zip(axes[:, 0], timelines.items(), strict=True):
        used |= _draw_one(ax, tl, label)
    axes[-1, 0].set_xlabel("time (ms)")
    order = [k for k in KIND_COLORS if k in used]
    fig.legend([Patch(color=KIND_COLORS[k]) for k in order], order, loc="lower center",
               ncol=min(8, len(order)), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    directory = os.path.dirname(os.path.abspath(target))
    tmp = os.path.join(directory, f".{os.path.basename(target)}.tmp")
    try:
        fig.savefig(tmp, format=ext, dpi=130,
                    metadata=dict(metadata) if metadata and ext == "png" else None)
        os.replace(tmp, target)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
