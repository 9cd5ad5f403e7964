"""Analysis of a run's gradient scales: figures and tables, framework-free."""

from gs_lightning.analysis.plots import (
    History,
    history_layers,
    history_matrix,
    layer_groups,
    plot_scale_heatmap,
    plot_scale_mean_std,
    save_scale_history,
)

__all__ = [
    "History",
    "history_layers",
    "history_matrix",
    "layer_groups",
    "plot_scale_heatmap",
    "plot_scale_mean_std",
    "save_scale_history",
]
