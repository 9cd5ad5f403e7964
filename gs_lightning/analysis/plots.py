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
from matplotlib.backends.backend_agg import FigureCanvasAgg
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


def plot_scale_heatmap(history: History, path: str | Path) -> Path:
    """Layer × step heatmap of log2 gradient scales (the paper's Figure 3b); returns the PNG's path."""
    steps, layers, matrix = history_matrix(history)
    fig = _figure(width=max(6.0, 0.35 * len(steps) + 3.0), height=_height(len(layers)))
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="log2 scale")
    ticks = _tick_positions(len(steps))
    ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
    ax.set_yticks(range(len(layers)), layers, fontsize=_label_size(len(layers)))
    ax.set_xlabel("step")
    ax.set_ylabel("layer (backward order)")
    ax.set_title("Gradient scale per layer (log2)")
    return _save(fig, path)


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
