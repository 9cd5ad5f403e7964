"""Train a recipe with a choice of mixed precision method.

    python train.py                                   # the built-in demo (no download)
    python train.py recipe=segnet precision=gs data.root=/datasets/CamVid
    python train.py -m recipe=segnet precision=gs,dynamic,fixed,fp32
    python train.py recipe=resnet50 precision=gs trainer=ddp trainer.devices=8 trainer.num_nodes=2

Recipes are recipes/<name>.yaml; the other config groups are in conf/.
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from gs_lightning.app import objective, override_hints, register_recipes, run

HERE = Path(__file__).resolve().parent
register_recipes(HERE / "recipes")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the recipe's ``optimized_metric`` for sweepers."""
    return objective(cfg, run(cfg))


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:
        hints = override_hints(sys.argv[1:], HERE / "conf") if stop.code not in (0, None) else []
        if hints:  # after Hydra's own message: the keys the user may have meant
            print(*hints, sep="\n", file=sys.stderr)
        raise
