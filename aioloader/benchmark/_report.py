"""The printed table, the JSON's machine block and the optional ratio chart."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Any

import torch

from aioloader.benchmark._harness import (
    Row,
    spdl_available,
)

# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0 or abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def format_table(rows: Sequence[Row], loaders: Sequence[str]) -> str:
    head = ["workload", "metric", "better", *loaders, "ratio", "target", "result"]
    body = []
    for r in rows:
        ratio = r.ratio()
        result = "" if r.passed is None else ("pass" if r.passed else "MISS")
        body.append(
            [
                r.workload,
                r.metric,
                r.better,
                *(_fmt(r.median(n)) for n in loaders),
                "-" if ratio is None else f"{ratio:.2f}x",
                r.target,
                result,
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    try:
        import aioloader

        aio_version = str(getattr(aioloader, "__version__", "unknown"))
    except ImportError:
        aio_version = "unavailable"
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "aioloader": aio_version,
        "spdl": spdl_available(),
    }


def write_plot(rows: Sequence[Row], path: str) -> None:
    """Bar chart of aioloader/torch per metric; green meets its target, red misses."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'aioloader[plot]'") from exc
    plotted = [r for r in rows if r.ratio() is not None]
    labels = [f"{r.workload}: {r.metric} ({r.better} better)" for r in plotted]
    ratios = [r.ratio() or 0.0 for r in plotted]
    colors = [
        "tab:gray" if r.passed is None else ("tab:green" if r.passed else "tab:red")
        for r in plotted
    ]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(plotted) + 1.2))
    ax.barh(range(len(plotted)), ratios, color=colors)
    ax.set_yticks(range(len(plotted)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("aioloader / torch (log; green = target met, red = missed, grey = no target)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
