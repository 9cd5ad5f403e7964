"""The README's and the user guide's Python code blocks, read from the Markdown and run as they stand.

README: each snippet of "Use it in your code" runs after the section's setup snippet, in a fresh
namespace and a temporary working directory. User guide (``docs/guide/*.md``): each page's blocks
run in order, in one namespace, after the guide's shared setup (the first block of
``docs/guide/index.md``). A line ending in ``# or: ALTERNATIVE`` also runs with ALTERNATIVE in its
place (the Trainer in pytorch_lightning). Blocks fenced as ``bash``, ``yaml`` or ``text`` are not run.

Also: every public name is in the API reference, the results pages are what the recorded runs
give, and the README stays short and names the CI's test command.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gs_lightning import GradientScaler

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide"
API = ROOT / "docs" / "api"
SECTION = "## Use it in your code"
PYTHON_BLOCK = r"```python\n(.*?)```"
PUBLIC_PACKAGES = (
    "gs_lightning",
    "gs_lightning.lightning",
    "gs_lightning.fabric",
    "gs_lightning.simulate",
    "gs_lightning.scaling",
    "gs_lightning.integrations",
)


def snippets() -> tuple[str, list[str]]:
    """The section's setup snippet and the snippets after it."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    setup, *rest = re.findall(PYTHON_BLOCK, section, flags=re.DOTALL)
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


def test_every_python_block_of_the_readme_is_in_the_section_the_tests_run() -> None:
    assert len(re.findall(PYTHON_BLOCK, README.read_text(), flags=re.DOTALL)) == 1 + len(SNIPPETS)


@pytest.mark.parametrize(
    "snippet", [variant for _, variant in CASES], ids=[variant.splitlines()[0][:40] for _, variant in CASES]
)
def test_snippet_runs_and_scales_every_batch(snippet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(SETUP + snippet, str(README), "exec"), namespace)  # noqa: S102 (running the README's code is the test)
    scaler = _gradient_scaler(namespace)
    assert scaler.iteration == len(namespace["data"])  # one scaled backward per batch


def _gradient_scaler(namespace: dict) -> GradientScaler:
    if isinstance(namespace.get("scaler"), GradientScaler):
        return namespace["scaler"]
    if "plugin" in namespace:
        return namespace["plugin"].scaler
    return namespace["trainer"].precision_plugin.scaler


def guide_pages() -> dict[str, str]:
    """{page: its Python blocks joined in order} for every user-guide page with any."""
    pages = {}
    for path in sorted(GUIDE.glob("*.md")):
        blocks = re.findall(PYTHON_BLOCK, path.read_text(), flags=re.DOTALL)
        if path.name == "index.md":
            blocks = blocks[1:]  # the first is the setup
        if blocks:
            pages[path.name] = "\n".join(blocks)
    return pages


GUIDE_SETUP = re.findall(PYTHON_BLOCK, (GUIDE / "index.md").read_text(), flags=re.DOTALL)[0]
GUIDE_CASES = [(page, variant) for page, code in guide_pages().items() for variant in variants(code)]


def test_the_guide_setup_is_the_readmes() -> None:
    assert GUIDE_SETUP == SETUP


@pytest.mark.parametrize(("page", "code"), GUIDE_CASES, ids=[f"{page}-{i}" for i, (page, _) in enumerate(GUIDE_CASES)])
def test_guide_page_runs(page: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(GUIDE_SETUP + code, str(GUIDE / page), "exec"), namespace)  # noqa: S102 (running the guide's code is the test)
    if "compiled" in namespace:  # the torch.compile page: per-layer scales inside the compiled backward
        scaler = namespace["scaler"]
        assert scaler.layers() and all(layer.kind != "opaque" for layer in scaler.layers())


def documented_names() -> set[str]:
    """Names the API pages render: a ``::: module`` directive renders its ``__all__`` (unless
    ``members: false``), a ``::: module.Name`` directive that one name."""
    names = set()
    for path in API.glob("*.md"):
        for match in re.finditer(
            r"^::: (?P<target>\S+)\n(?P<options>(?:    .*\n)*)", path.read_text(), flags=re.MULTILINE
        ):
            target = match.group("target")
            try:
                module = importlib.import_module(target)
            except ModuleNotFoundError:
                names.add(target.rsplit(".", 1)[1])
                continue
            if "members: false" not in match.group("options"):
                names.update(module.__all__)
    return names


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_public_name_is_in_the_api_reference(package: str) -> None:
    missing = sorted(set(importlib.import_module(package).__all__) - documented_names())
    assert not missing, f"{package}: {missing} are in __all__ but no page of docs/api/ renders them"


def test_the_results_pages_are_what_the_recorded_runs_give() -> None:
    check = subprocess.run(
        [sys.executable, "bench/docs_results.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr


def test_the_readme_is_short_and_names_the_ci_test_command() -> None:
    readme = README.read_text()
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if "pytest" in line)
    assert command in readme, f"README.md does not show .ci/run's test command {command!r}"
