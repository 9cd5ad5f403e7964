"""The README's "Use it in your code" snippets, read from README.md and run as they stand.

Each snippet runs after the section's setup snippet, in a fresh namespace and a temporary working
directory. A line ending in ``# or: ALTERNATIVE`` also runs with ALTERNATIVE in its place (the
Trainer snippet in pytorch_lightning).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gs_lightning import GradientScaler

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Use it in your code"


def snippets() -> tuple[str, list[str]]:
    """The section's setup snippet and the snippets after it."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    setup, *rest = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    return setup, rest


def variants(snippet: str) -> list[str]:
    """The snippet as written, and once per ``# or:`` alternative."""
    found = [snippet]
    for match in re.finditer(r"^(?P<code>[^\n#]+?)\s*# or: (?P<alternative>[^\n]+)$", snippet, flags=re.MULTILINE):
        found.append(snippet.replace(match.group(0), match.group("alternative")))
    return found


SETUP, SNIPPETS = snippets()
CASES = [(i, variant) for i, snippet in enumerate(SNIPPETS) for variant in variants(snippet)]


def test_the_section_shows_every_entry_point() -> None:
    code = "\n".join(SNIPPETS)
    for entry_point in ("pl.Trainer(", "L.Fabric(", "scaler.scale(loss).backward()", "scaler.backward(loss)"):
        assert entry_point in code, entry_point
    assert "import pytorch_lightning as pl" in code


@pytest.mark.parametrize("snippet", [variant for _, variant in CASES], ids=[variant.splitlines()[0][:40] for _, variant in CASES])
def test_snippet_runs_and_scales_every_batch(snippet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(SETUP + snippet, str(README), "exec"), namespace)  # noqa: S102 (running the README's code is the test)
    scaler = _gradient_scaler(namespace)
    assert scaler.iteration == len(namespace["data"])  # one scaled backward per batch
    if "compiled" in namespace:  # the torch.compile snippet: per-layer scales inside the compiled backward
        assert scaler.layers() and all(layer.kind != "opaque" for layer in scaler.layers())


def _gradient_scaler(namespace: dict) -> GradientScaler:
    if isinstance(namespace.get("scaler"), GradientScaler):
        return namespace["scaler"]
    if "plugin" in namespace:
        return namespace["plugin"].scaler
    return namespace["trainer"].precision_plugin.scaler
