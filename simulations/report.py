"""Results of a simulation run: a table on screen, CSV and JSON on disk, PNG plots.

Rows are plain dicts with the same keys (one per cell, see
:func:`simulations.accuracy.summarize`). Plots draw the measured error against
epsilon, one line per mechanism (its own colour, marker, marker size and line style) and
its theory as a thin black dashed line (one legend entry, "theory"), one figure per
combination of the other grid axes (domain size, n, shape).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "error_figure",
    "format_table",
    "plot_error_against_epsilon",
    "save_figure",
    "series_style",
    "theory_style",
    "write_csv",
    "write_json",
]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A fixed-width text table of ``columns`` of ``rows``."""
    cells = [[_cell(row.get(column, "")) for column in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """``rows`` as CSV with a header (columns in the order of the first row's keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON (NaN and infinities written as null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(data), indent=2) + "\n")


#: Measured lines: mechanism i gets colour Ci, MARKERS[i] (open, so that points drawn over
#: each other stay visible), MARKER_SIZES[i] (so that open markers at one point nest
#: inside each other rather than cover each other) and LINE_STYLES[i], all slightly
#: transparent, so that mechanisms with equal errors (auto picks oue or olh, whose
#: variances match) remain distinguishable where their lines coincide. The theory is
#: always thin, black and dashed, a style no measured line uses.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
LINE_STYLES: tuple[str | tuple[int, tuple[int, ...]], ...] = (
    "-", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 2)),
)  # fmt: skip
MARKER_SIZES = (9.0, 7.0, 5.0)
THEORY_STYLE = "--"
#: The label of the theory lines in a legend (given to one of them only).
THEORY_LABEL = "theory (analytical)"


def series_style(index: int) -> dict[str, Any]:
    """Matplotlib keywords of the ``index``-th measured line (a mechanism, a training setup).

    Marker and line style are each distinct among consecutive mechanisms, and the pair is
    distinct for the first ``lcm(len(MARKERS), len(LINE_STYLES))`` = 30.
    """
    return {
        "color": f"C{index % 10}",
        "marker": MARKERS[index % len(MARKERS)],
        "markersize": MARKER_SIZES[index % len(MARKER_SIZES)],
        "linestyle": LINE_STYLES[index % len(LINE_STYLES)],
        "markerfacecolor": "none",
        "alpha": 0.85,
    }


def theory_style(labelled: bool) -> dict[str, Any]:
    """Matplotlib keywords of a theory line: thin, black, dashed, drawn under the measured
    lines; give one of them ``labelled`` (the last drawn, so that it ends the legend) and
    the legend has one entry for them all."""
    return {
        "color": "black",
        "linestyle": THEORY_STYLE,
        "linewidth": 1.0,
        "alpha": 0.6,
        "zorder": 1.5,
        "label": THEORY_LABEL if labelled else "_theory",
    }


def error_figure(rows: Sequence[dict[str, Any]], title: str) -> Figure:
    """MSE against epsilon for the mechanisms in ``rows``, each with its theory (black,
    dashed, one legend entry)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.4))
    mechanisms = list(dict.fromkeys(row["mechanism"] for row in rows))
    for index, mechanism in enumerate(mechanisms):
        mine = sorted((r for r in rows if r["mechanism"] == mechanism), key=lambda r: r["epsilon"])
        eps = [r["epsilon"] for r in mine]
        style = series_style(index)
        axes.plot(eps, [r["mse"] for r in mine], label=mechanism, **style)
        axes.plot(eps, [r["variance"] for r in mine], **theory_style(index == len(mechanisms) - 1))
    axes.set_xlabel("epsilon")
    axes.set_ylabel("mean squared error")
    axes.set_yscale("log")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def save_figure(figure: Figure, path: Path) -> None:
    """Write ``figure`` as a PNG at ``path`` (creating its directory) and release it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_error_against_epsilon(
    rows: Sequence[dict[str, Any]], out_dir: Path, prefix: str, group_by: Sequence[str]
) -> list[Path]:
    """One PNG per value of ``group_by`` (:func:`error_figure`); the paths written."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[key] for key in group_by), []).append(row)
    written = []
    for key, group in groups.items():
        title = ", ".join(f"{k}={v}" for k, v in zip(group_by, key, strict=True))
        name = "_".join([prefix] + [f"{k}-{v}" for k, v in zip(group_by, key, strict=True)])
        path = out_dir / (name.replace(":", "-").replace("/", "-").replace(" ", "") + ".png")
        save_figure(error_figure(group, title), path)
        written.append(path)
    return written
