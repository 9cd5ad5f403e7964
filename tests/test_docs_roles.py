"""The docs' griffe extension (docs/_griffe/sphinx_roles.py): Sphinx markup in docstrings rendered as Markdown."""

import importlib.util
import re
from pathlib import Path

import griffe
import markdown
import pytest
from mkdocs_autorefs import fix_refs

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = ROOT / "docs" / "_griffe" / "sphinx_roles.py"
RAW_ROLE = re.compile(r":(?:py:)?[a-z]+:`")


def _load_module():
    spec = importlib.util.spec_from_file_location("sphinx_roles", EXTENSION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sphinx_roles = _load_module()


@pytest.fixture(scope="module")
def package() -> griffe.Module:
    # Loaded as mkdocs.yml loads it: by the extension's path.
    extensions = griffe.load_extensions(str(EXTENSION))
    return griffe.load("gs_lightning", search_paths=[ROOT], extensions=extensions, docstring_parser="google")


def _public(obj: griffe.Object) -> bool:
    return not any(part.startswith("_") for part in obj.path.split("."))


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.M | re.S)


def test_no_public_docstring_keeps_sphinx_markup(package):
    left = []
    for obj in sphinx_roles.iter_objects(package):
        if obj.docstring is None or not _public(obj):
            continue
        prose = _prose(obj.docstring.value)
        if RAW_ROLE.search(prose) or re.search(r"::\s*$", prose, re.M):
            left.append(obj.path)
    assert not left, f"docstrings still holding a Sphinx role or a '::' marker: {left}"


def test_absolute_reference_becomes_optional_autoref(package):
    resolver = sphinx_roles.Resolver(package)
    owner = package["simulate"]
    converted = sphinx_roles.convert_docstring(
        "See :class:`~gs_lightning.scaling.recipe.ScalingRecipe` and :class:`gs_lightning.GradientScaler`.",
        owner,
        resolver,
    )
    # `~`: the last name shown; the link goes to where the object is defined, which autorefs maps to where it is shown.
    assert converted == (
        'See <autoref identifier="gs_lightning.scaling.recipe.ScalingRecipe" optional>`ScalingRecipe`</autoref> and '
        '<autoref identifier="gs_lightning.scaling.scaler.GradientScaler" optional>'
        "`gs_lightning.GradientScaler`</autoref>."
    )


def test_relative_references_resolve_in_scope(package):
    resolver = sphinx_roles.Resolver(package)
    scaler = package["scaling.scaler.GradientScaler"]
    # A method named from its class's docstring, and a class's member named through the class.
    assert resolver.resolve(scaler, "step") == "gs_lightning.scaling.scaler.GradientScaler.step"
    assert resolver.resolve(scaler.members["backward"], "ScalingRecipe.paper") == (
        "gs_lightning.scaling.recipe.ScalingRecipe.paper"
    )
    assert resolver.resolve(scaler, "no_such_name") is None


def test_role_titles_and_fallbacks(package):
    resolver = sphinx_roles.Resolver(package)
    owner = package["scaling.scaler.GradientScaler"]

    def convert(text: str) -> str:
        return sphinx_roles.convert_docstring(text, owner, resolver)

    step = '<autoref identifier="gs_lightning.scaling.scaler.GradientScaler.step" optional>'
    assert convert(":meth:`step`") == f"{step}`step()`</autoref>"
    assert convert(":meth:`the step <step>`") == f"{step}`the step`</autoref>"
    assert convert(":meth:`!step`") == "`step()`"
    assert convert(":attr:`no_such_name`") == "`no_such_name`"  # nothing to link: plain code
    # Outside the package: kept linkable (plain text unless the site ever renders it), roles wrapped over lines too.
    assert (
        convert(":class:`torch.nn.\n    Module`")
        == '<autoref identifier="torch.nn.Module" optional>`torch.nn.Module`</autoref>'
    )


def test_literal_blocks_become_fenced_code(package):
    resolver = sphinx_roles.Resolver(package)
    owner = package["scaling.scaler.GradientScaler"]
    text = "Use it like this::\n\n    x = f(1)\n\nThen ::\n\n    $ shell command\n\n::\n\n    y = 2\n\nThe end."
    assert sphinx_roles.convert_docstring(text, owner, resolver) == (
        "Use it like this:\n\n```python\nx = f(1)\n```\n\nThen\n\n```text\n$ shell command\n```\n\n"
        "```python\ny = 2\n```\n\nThe end."
    )
    # A "::" with no indented block after it is not a literal block, and roles in code are left alone.
    assert sphinx_roles.convert_docstring("a::b::\nno block", owner, resolver) == "a::b::\nno block"
    fenced = "```python\n# :class:`GradientScaler`\n```"
    assert sphinx_roles.convert_docstring(fenced, owner, resolver) == fenced


def test_plugins_are_documented_classes(package):
    # Made without a docstring of their own that static analysis can see; the pages must still show them.
    for path in ("fabric.GradientScalingPlugin", "lightning.GradientScalingPlugin"):
        plugin = package[path].final_target if package[path].is_alias else package[path]
        assert plugin.is_class and plugin.docstring is not None, path


DEMO = """
__all__ = ["Base", "Made", "NOT_A_CLASS"]


class Base:
    \"\"\"The base; see :class:`Made`.\"\"\"


_MADE = {"Made": type("Made", (Base,), {"__module__": __name__, "__qualname__": "Made", "__doc__": "Made at import."})}
Made = _MADE["Made"]
NOT_A_CLASS = dict(a=1)
"""


def test_classes_made_at_import(tmp_path, monkeypatch):
    (tmp_path / "sphinx_roles_demo").mkdir()
    (tmp_path / "sphinx_roles_demo" / "__init__.py").write_text(DEMO)
    monkeypatch.syspath_prepend(str(tmp_path))
    extensions = griffe.load_extensions(str(EXTENSION))
    demo = griffe.load("sphinx_roles_demo", search_paths=[tmp_path], extensions=extensions)
    # A class made at import: a class, with its bases and its docstring; references to it resolve.
    made = '<autoref identifier="sphinx_roles_demo.Made" optional>`Made`</autoref>'
    assert demo["Base"].docstring.value == f"The base; see {made}."
    assert demo["Made"].is_class
    assert demo["Made"].docstring.value == "Made at import."
    assert [base.canonical_path for base in demo["Made"].bases] == ["sphinx_roles_demo.Base"]
    assert demo["NOT_A_CLASS"].is_attribute


def test_reference_renders_as_link_where_rendered_and_as_code_elsewhere(package):
    resolver = sphinx_roles.Resolver(package)
    owner = package["scaling.scaler.GradientScaler"]
    text = "The recipe (:class:`~gs_lightning.scaling.recipe.ScalingRecipe`), then :meth:`step`."
    html = markdown.markdown(sphinx_roles.convert_docstring(text, owner, resolver))
    urls = {"gs_lightning.scaling.recipe.ScalingRecipe": "../scaling/#gs_lightning.scaling.ScalingRecipe"}

    def url_mapper(identifier: str) -> tuple[str, str | None]:
        return urls[identifier], None

    fixed, unmapped = fix_refs(html, url_mapper)
    assert not unmapped  # optional references never fail a strict build
    link = r'<a [^>]*href="\.\./scaling/#gs_lightning\.scaling\.ScalingRecipe"[^>]*><code>ScalingRecipe</code></a>'
    assert re.search(link, fixed)
    # A target the site does not render is plain code, titled with its path.
    assert '<span title="gs_lightning.scaling.scaler.GradientScaler.step"><code>step()</code></span>' in fixed


def test_class_made_at_import_that_cannot_be_imported_is_warned_about(tmp_path, monkeypatch, caplog):
    (tmp_path / "sphinx_roles_broken").mkdir()
    (tmp_path / "sphinx_roles_broken" / "__init__.py").write_text('__all__ = ["Made"]\nMade = {}["Made"]\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    extensions = griffe.load_extensions(str(EXTENSION))
    with caplog.at_level("WARNING"):
        broken = griffe.load("sphinx_roles_broken", search_paths=[tmp_path], extensions=extensions)
    assert broken["Made"].is_attribute
    assert "sphinx_roles_broken is imported to document Made, made at import time, and failed: KeyError" in caplog.text
