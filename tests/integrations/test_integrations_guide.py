"""docs/guide/integrations.md: each section's Python code runs as it stands and trains with a GradientScaler.

A section's code blocks run in order in one fresh namespace, in a temporary working directory (the
Trainer and timm's saver write checkpoints there)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from integration_helpers import fresh_accelerate_state

from gs_lightning import GradientScaler

pytestmark = pytest.mark.usefixtures(fresh_accelerate_state.__name__)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "integrations.md"


def sections() -> dict[str, str]:
    """{section title: its Python code blocks joined}, for the sections that have any."""
    found = {}
    for section in GUIDE.read_text().split("\n## ")[1:]:
        title, body = section.split("\n", 1)
        blocks = re.findall(r"```python\n(.*?)```", body, flags=re.DOTALL)
        if blocks:
            found[title.strip()] = "\n".join(blocks)
    return found


SECTIONS = sections()


def test_every_integration_has_runnable_code() -> None:
    assert {"Hugging Face Accelerate", "Transformers Trainer", "timm", "fp16 on a CPU"} <= SECTIONS.keys()
    code = "\n".join(SECTIONS.values())
    for line in (
        "install_gradient_scaler(accelerator, GradientScaler(model))",
        "GradientScalingTrainer(model=model",
        "loss_scaler = TimmGradientScaler(GradientScaler(model))",
    ):
        assert line in code, line


# the Trainer's default, on a CPU
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
@pytest.mark.parametrize("title", SECTIONS)
def test_section_code_runs_and_scales(title: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(SECTIONS[title], f"{GUIDE}:{title}", "exec"), namespace)  # noqa: S102 (running the guide's code is the test)
    scalers = [
        s
        for value in namespace.values()
        for s in (value, getattr(value, "scaler", None), getattr(value, "gradient_scaler", None))
        if isinstance(s, GradientScaler)
    ]
    assert scalers and all(s.iteration >= 2 for s in scalers)
