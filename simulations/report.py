"""Results of a simulation run: a table on screen, CSV and JSON on disk, PNG plots.

Rows are plain dicts with the same keys (one per cell, see
:func:`simulations.accuracy.summarize`). Plots draw the measured error against
epsilon, one solid line per mechanism and its theory dashed in the same colour, one
figure per combination of the other grid axes (domain size, n, shape).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["format_table", "plot_error_against_epsilon", "write_csv", "write_json"]


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


def plot_error_against_epsilon(
    rows: Sequence[dict[str, Any]], out_dir: Path, prefix: str, group_by: Sequence[str]
) -> list[Path]:
    """One PNG per value of ``group_by``: MSE against epsilon, theory dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[key] for key in group_by), []).append(row)
    written = []
    for key, group in groups.items():
        figure, axes = plt.subplots(figsize=(6.4, 4.4))
        mechanisms = list(dict.fromkeys(row["mechanism"] for row in group))
        for index, mechanism in enumerate(mechanisms):
            mine = sorted(
                (r for r in group if r["mechanism"] == mechanism), key=lambda r: r["epsilon"]
            )
            eps = [r["epsilon"] for r in mine]
            colour = f"C{index % 10}"
            axes.plot(eps, [r["mse"] for r in mine], "o-", color=colour, label=mechanism)
            axes.plot(eps, [r["variance"] for r in mine], "--", color=colour, alpha=0.7)
        axes.set_xlabel("epsilon")
        axes.set_ylabel("mean squared error (dashed: theory)")
        axes.set_yscale("log")
        axes.set_title(", ".join(f"{k}={v}" for k, v in zip(group_by, key, strict=True)))
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
        name = "_".join([prefix] + [f"{k}-{v}" for k, v in zip(group_by, key, strict=True)])
        path = out_dir / (name.replace(":", "-").replace("/", "-").replace(" ", "") + ".png")
        out_dir.mkdir(parents=True, exist_ok=True)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
