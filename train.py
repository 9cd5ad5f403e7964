"""Train a recipe with a choice of mixed precision method.

    python train.py                                   # the built-in demo (no download)
    python train.py recipe=segnet precision=gs data.root=/datasets/CamVid
    python train.py -m recipe=segnet precision=gs,dynamic,fixed,fp32
    python train.py recipe=resnet50 precision=gs trainer=ddp trainer.devices=8 trainer.num_nodes=2

Recipes are recipes/<name>.yaml; the other config groups are in conf/.
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from gs_lightning.app import objective, register_recipes, run

register_recipes(Path(__file__).resolve().parent / "recipes")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the recipe's ``optimized_metric`` for sweepers."""
    return objective(cfg, run(cfg))


if __name__ == "__main__":
    main()
