"""Figures and tables of a run's per-layer gradient scales (the paper's Figures 2 and 3b).

Framework-free: every function takes a scale history ``{step: {layer: log2 scale}}`` and an output
path. Figures are drawn on matplotlib ``Figure`` objects with the Agg canvas, never through pyplot,
so no global backend is set and nothing needs a display.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure

History = Mapping[int, Mapping[str, float]]
"""{optimizer step: {layer name: log2 of the layer's gradient scale}}."""


def history_layers(history: History) -> list[str]:
    """Every layer of the history, in order of first appearance (backward order for one update)."""
    return list(dict.fromkeys(layer for step in sorted(history) for layer in history[step]))


def history_matrix(history: History) -> tuple[list[int], list[str], np.ndarray]:
    """(steps, layers, layer × step array of log2 scales, NaN where a layer has no value)."""
    steps = sorted(history)
    layers = history_layers(history)
    matrix = np.full((len(layers), len(steps)), np.nan)
    row = {layer: i for i, layer in enumerate(layers)}
    for j, step in enumerate(steps):
        for layer, value in history[step].items():
            matrix[row[layer], j] = value
    return steps, layers, matrix


def layer_groups(layers: Iterable[str]) -> dict[str, list[str]]:
    """Layers grouped by top-level module, order kept: ``"model.layer1.0.conv1"`` → ``"layer1"``.

    Leading name parts that every layer shares (a LightningModule's ``model.``) are skipped first.
    """
    layers = list(layers)
    parts = [layer.split(".") for layer in layers]
    shared = 0
    while parts and all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    groups: dict[str, list[str]] = {}
    for layer, p in zip(layers, parts):
        groups.setdefault(p[shared], []).append(layer)
    return groups


def plot_scale_heatmap(
    history: History, path: str | Path, update_steps: Iterable[int] = (), title: str | None = None
) -> Path:
    """Layer × step heatmap of log2 gradient scales (the paper's Figure 3b); returns the PNG's path.

    The colours diverge from white at 0 (a scale of 1), red above and blue below, one colour per
    binade, every nonzero one at least a third saturated: -1, 0 and +1 stand apart on a range of
    ±16. Grey cells are layers without a value at that step.

    Args:
        history: ``{step: {layer: log2 scale}}``.
        path: the PNG to write.
        update_steps: the steps whose backward decided the scales; the first column that shows an
            update's scales is marked ▼ above the map.
        title: the figure's title (say which run and precision); a generic one by default.
    """
    steps, layers, matrix = history_matrix(history)
    fig = _figure(width=max(6.0, 0.35 * len(steps) + 3.0), height=_height(len(layers)))
    ax = fig.subplots()
    cmap, norm, ticks = _diverging_binades(matrix)
    image = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    fig.colorbar(image, ax=ax, label="log2 scale", ticks=ticks)
    columns = sorted({int(np.searchsorted(steps, step)) for step in update_steps} & set(range(len(steps))))
    if columns:
        ax.scatter(columns, [-0.5] * len(columns), marker="v", s=40, color="black", clip_on=False, zorder=3)
    ticks = _tick_positions(len(steps))
    ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
    ax.set_yticks(range(len(layers)), layers, fontsize=_label_size(len(layers)))
    ax.set_xlabel("step" + ("   (▼ the scales were updated since the previous column)" if columns else ""))
    ax.set_ylabel("layer (backward order)")
    ax.set_title(title or "Gradient scale per layer (log2)", fontsize=9, pad=10 if columns else 6)  # clear of the ▼
    return _save(fig, path)


def _diverging_binades(matrix: np.ndarray) -> tuple[ListedColormap, BoundaryNorm, list[int]]:
    """A colour per integer log2 scale over ±(the largest magnitude, at least 1): white at 0, then
    from a third of the way to full red (above) or blue (below); the colour bar's ticks."""
    finite = matrix[np.isfinite(matrix)]
    reach = max(1, int(np.ceil(np.abs(finite).max()))) if finite.size else 1
    levels = np.arange(-reach, reach + 1)
    positions = 0.5 + np.sign(levels) * (1 / 6 + (1 / 3) * np.abs(levels) / reach)
    colours = colormaps["RdBu_r"](positions)
    colours[reach] = (1.0, 1.0, 1.0, 1.0)
    cmap = ListedColormap(colours).with_extremes(bad="0.75")
    norm = BoundaryNorm(np.arange(-reach - 0.5, reach + 1.0), ncolors=len(levels))
    step = -(-len(levels) // 17)  # at most 17 labels, 0 among them
    return cmap, norm, [int(level) for level in levels if level % step == 0]


def plot_scale_mean_std(history: History, path: str | Path, totals: History | None = None) -> Path:
    """Mean ± standard deviation over steps of each layer's log2 scale (the paper's Figure 2).

    With ``totals`` (the same layout, log2 of the accumulated scale each layer's outgoing gradient
    carries) both are drawn per layer: most local scales are 2^0, and the accumulated scale shows
    what each gradient is actually multiplied by. Returns the PNG's path.
    """
    _, layers, matrix = history_matrix(history)
    fig = _figure(width=7.0, height=_height(len(layers)))
    ax = fig.subplots()
    rows = np.arange(len(layers))
    series = [("local scale", matrix, "tab:blue")]
    if totals:
        _, total_layers, total_matrix = history_matrix(totals)
        order = [total_layers.index(layer) if layer in total_layers else None for layer in layers]
        aligned = np.array([total_matrix[i] if i is not None else np.full(matrix.shape[1:], np.nan) for i in order])
        series.append(("accumulated scale", aligned, "tab:orange"))
    height = 0.8 / len(series)
    for k, (label, values, colour) in enumerate(series):
        means, stds = _nan_mean_std(values)
        offset = (k - (len(series) - 1) / 2) * height
        ax.barh(rows + offset, means, height=height, xerr=stds, color=colour, ecolor="black", capsize=2, label=label)
    ax.set_yticks(rows, layers, fontsize=_label_size(len(layers)))
    ax.invert_yaxis()  # backward order from the top, as in the heatmap
    ax.axvline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("log2 scale (mean ± std over steps)")
    ax.set_ylabel("layer (backward order)")
    ax.set_title("Gradient scale per layer")
    if len(series) > 1:
        fig.legend(loc="outside lower center", ncols=len(series), fontsize=8)
    return _save(fig, path)


def _nan_mean_std(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row mean and std ignoring NaN; 0 for a row without any value."""
    counts = np.sum(~np.isnan(values), axis=1)
    filled = np.where(np.isnan(values), 0.0, values)
    means = filled.sum(axis=1) / np.maximum(counts, 1)
    stds = np.sqrt(np.where(np.isnan(values), 0.0, (values - means[:, None]) ** 2).sum(axis=1) / np.maximum(counts, 1))
    return means, stds


def save_scale_history(history: History, path: str | Path) -> Path:
    """The history as CSV: a ``step`` column and one column per layer (empty where a layer has no value)."""
    steps, layers, matrix = history_matrix(history)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["step", *layers])
        for j, step in enumerate(steps):
            writer.writerow([step, *("" if np.isnan(v) else f"{v:g}" for v in matrix[:, j])])
    return path


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _height(rows: int) -> float:
    return max(3.0, 0.22 * rows + 1.5)


def _label_size(rows: int) -> float:
    return 8.0 if rows <= 40 else 6.0


def _tick_positions(count: int, most: int = 20) -> list[int]:
    return list(range(0, count, max(1, -(-count // most))))


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
