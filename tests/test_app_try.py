"""docs/guide/app.md's commands that try each recipe without its dataset (``++data.synthetic={...}``):
each one, read from the page, trains, validates and tests (shrunk to 2 steps and a small model), and
a missing dataset's error names the same overrides."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from test_app import QUIET, RECIPES, ROOT, _compose

from gs_lightning.app import GENERATED_DATA, run
from gs_lightning.data.synthetic import generated_dataset

PAGE = ROOT / "docs" / "guide" / "app.md"


def documented_commands() -> dict[str, list[str]]:
    """The overrides of each ``python train.py recipe=...`` line of the page's section "Trying a recipe
    without its dataset", by recipe, split as a POSIX shell splits them."""
    section = PAGE.read_text().split("## Trying a recipe without its dataset", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    commands = {}
    for line in block.strip().splitlines():
        program, script, *overrides = shlex.split(line)
        assert (program, script) == ("python", "train.py") and overrides[0].startswith("recipe="), line
        commands[overrides[0].removeprefix("recipe=")] = overrides[1:]
    return commands


COMMANDS = documented_commands()

# What shrinks a documented command to seconds on a CPU; each replaces the command's own setting of
# its key. The generator's settings, data.root and every other override stay as documented.
SHRINK = [
    "trainer.max_steps=2",
    "data.batch_size=2",
    "data.num_workers=0",
    "++trainer.limit_train_batches=2",  # an epoch of 2 steps: the epoch-driven recipes validate too
    "++trainer.limit_val_batches=1",
    "++trainer.limit_test_batches=1",
]
SMALL_MODEL = {
    "segnet": ["model.width=4"],
    "resnet": ["data.image_size=16", "data.val_resize=18"],
    "ssd": ["model.width_mult=0.03125"],
}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _shrunk(recipe: str, overrides: list[str]) -> list[str]:
    extra = [*SHRINK, *SMALL_MODEL[re.sub(r"\d+$", "", recipe)]]
    if any(_key(o) == "trainer.val_check_interval" for o in overrides):
        extra.append("trainer.val_check_interval=1")  # validation within the 2 steps
    replaced = {_key(o) for o in extra}
    return [o for o in overrides if _key(o) not in replaced] + extra


def test_the_page_documents_every_real_recipe() -> None:
    assert sorted(COMMANDS) == sorted(r for r in RECIPES if r != "demo")


@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=pytest.mark.slow) if r in ("resnet50", "ssd512") else r for r in sorted(COMMANDS)]
)
def test_the_documented_command_trains_validates_and_tests(recipe: str, tmp_path: Path) -> None:
    """The documented overrides, shrunk, with the generated data under a temporary paths.cache_dir.
    Validation and test are one batch each: SSD's evaluation is slow on an emulating CPU."""
    overrides = _shrunk(recipe, COMMANDS[recipe])
    cfg = _compose(
        [f"recipe={recipe}", f"paths.output_dir={tmp_path / 'out'}", f"paths.cache_dir={tmp_path}", *QUIET, *overrides]
    )
    assert cfg.precision.emulate == "auto"  # as a user's run: fp16 emulated on the CPU
    metrics = run(cfg)
    assert cfg.optimized_metric in metrics and cfg.optimized_metric.replace("test/", "val/") in metrics
    assert Path(cfg.data.root).is_relative_to(tmp_path) and generated_dataset(cfg.data.root) is not None


@pytest.mark.parametrize("recipe", ["segnet", "resnet18", "ssd300"])
def test_a_missing_dataset_names_the_documented_overrides(recipe: str, tmp_path: Path) -> None:
    """Without its dataset a recipe stops with one line that names the overrides its documented
    command uses to train on generated data instead."""
    cfg = _compose(
        [
            f"recipe={recipe}",
            f"paths.output_dir={tmp_path / 'out'}",
            f"paths.data_dir={tmp_path / 'nothing'}",
            *QUIET,
            *SHRINK,
            *SMALL_MODEL[re.sub(r"\d+$", "", recipe)],
            *(["model.pretrained=false"] if recipe.startswith("ssd") else []),
        ]
    )
    with pytest.raises(SystemExit) as info:
        run(cfg)
    message = info.value.code
    generated = GENERATED_DATA[cfg.data._target_.rsplit(".", 1)[-1]]
    assert isinstance(message, str) and "\n" not in message, message
    assert f"to try the recipe without the dataset, on generated data: {generated}, see docs/guide/app.md" in message
    assert set(shlex.split(generated)) <= set(COMMANDS[recipe])
