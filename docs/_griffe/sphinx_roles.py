"""Griffe extension: render the package's Sphinx (reST) docstring markup in mkdocstrings.

The docstrings are Google style but cross-reference with Sphinx roles (:class:`~a.b.C`, :meth:`step`, ...) and
introduce code examples with reST's ``::``. Markdown shows both raw, so once the package is loaded this rewrites every
docstring of it:

* ``:role:`target``` (``class``, ``mod``, ``meth``, ``func``, ``attr``, ``data``, ``obj``, ``exc``, optionally
  ``py:``-prefixed) becomes an optional autorefs cross-reference to the target's fully qualified path, titled as
  Sphinx titles it (``~`` keeps the last name, ``title <target>`` the title, ``()`` after functions and methods).
  Relative targets (``step``, ``ScalingRecipe.paper``) are looked up the way Sphinx does: the class, its bases, the
  enclosing module and packages, then a name unique in the package. "Optional" is autorefs' own mechanism for
  annotations: the reference is a link wherever the target is rendered on the site, and plain code where it is not,
  so ``mkdocs build --strict`` never fails on a reference to something the API pages leave out. A target that is
  neither in the package nor dotted (so cannot be anything rendered) becomes plain inline code.
* A name exported by an ``__all__`` and bound to a class made at import time (``X = make_classes()["X"]``, invisible
  to static analysis) is documented as that class, read from the imported module.
* A paragraph ending in ``::`` followed by an indented block becomes the paragraph ending in ``:`` (or nothing, for
  a lone or space-separated ``::``) and a fenced code block, highlighted as Python when the block parses as Python.

Load it with ``extensions: [docs/_griffe/sphinx_roles.py]`` in mkdocstrings-python's options.
"""

from __future__ import annotations

import ast
import html
import importlib
import inspect
import re
import textwrap
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import griffe

__all__ = ["SphinxRoles", "convert_docstring", "Resolver"]

ROLES = ("class", "mod", "meth", "func", "attr", "data", "obj", "exc")
_CALLABLE_ROLES = {"meth", "func"}
# A role may wrap over a line break inside its backticks (the source docstrings are hard-wrapped).
ROLE_RE = re.compile(r":(?:py:)?(?P<role>" + "|".join(ROLES) + r"):`(?P<body>[^`]+)`")
_EXPLICIT_TITLE_RE = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)
_FENCE_RE = re.compile(r"^\s*(```|~~~)")


class Resolver:
    """Finds the object a Sphinx cross-reference target names, seen from one docstring's owner."""

    def __init__(self, package: griffe.Module) -> None:
        # Suffix ("paper", "ScalingRecipe.paper") -> the objects of the package whose path ends with it, for
        # targets named neither in scope nor absolutely (Sphinx's fallback search). Aliases are left out: an
        # alias names an object defined elsewhere in the package (found there) or outside it (not ours to link).
        self._by_suffix: dict[str, list[griffe.Object]] = defaultdict(list)
        for obj in iter_objects(package):
            parts = obj.path.split(".")
            for n in range(1, len(parts)):
                self._by_suffix[".".join(parts[-n:])].append(obj)

    def resolve(self, owner: griffe.Object, target: str) -> str | None:
        """The fully qualified path of what ``target`` names in ``owner``'s docstring, or None if nothing does.

        Args:
            owner: The object whose docstring holds the reference.
            target: The role's target, without ``~``/``!``/``.`` prefixes.
        """
        found = self._in_scope(owner, target) or self._absolute(owner, target)
        if found is None:
            candidates = self._by_suffix.get(target, [])
            found = candidates[0] if len(candidates) == 1 else None
        return None if found is None else found.path

    def _in_scope(self, owner: griffe.Object, target: str) -> griffe.Object | None:
        scope: griffe.Object | None = owner if owner.is_class or owner.is_module else owner.parent
        while scope is not None:
            found = _walk(scope, target.split("."))
            if found is not None:
                return found
            scope = scope.parent
        return None

    def _absolute(self, owner: griffe.Object, target: str) -> griffe.Object | None:
        try:
            found = owner.modules_collection.get_member(target)
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
        return _final(found)


def _final(obj: griffe.Object | griffe.Alias) -> griffe.Object | None:
    """The object an alias finally points at (None if that is outside what is loaded)."""
    if not obj.is_alias:
        return obj
    try:
        return obj.final_target
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _member(scope: griffe.Object, name: str) -> griffe.Object | None:
    """``scope``'s member ``name``, declared or, for a class, inherited from a base that is loaded."""
    if name in scope.members:
        return _final(scope.members[name])
    if scope.is_class:
        for base in scope.resolved_bases:
            found = _member(base, name)
            if found is not None:
                return found
    return None


def _walk(scope: griffe.Object, parts: list[str]) -> griffe.Object | None:
    found: griffe.Object | None = scope
    for name in parts:
        found = _member(found, name)
        if found is None:
            return None
    return found


def iter_objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined under it (aliases, i.e. imports and re-exports, left out)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from iter_objects(member)


def _role_replacement(match: re.Match[str], owner: griffe.Object, resolver: Resolver) -> str:
    role, body = match["role"], " ".join(match["body"].split())
    explicit = _EXPLICIT_TITLE_RE.match(body)
    title, target = (explicit["title"], explicit["target"]) if explicit else (None, body)
    target = "".join(target.split())  # a path wrapped over a line break is still one path
    no_link = target.startswith("!")
    short = target.startswith("~")
    target = target.lstrip("!~").lstrip(".")
    if title is None:
        title = target.rsplit(".", 1)[-1] if short else target
        if role in _CALLABLE_ROLES and not title.endswith(")"):
            title += "()"
    code = f"`{title}`"
    if no_link:
        return code
    path = resolver.resolve(owner, target)
    if path is None and "." in target and not target.startswith("self."):
        path = target  # outside the package (torch.nn.Module): still linkable if ever rendered
    if path is None:
        return code
    return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'


def _literal_block_lines(lines: list[str]) -> list[str]:
    """Turn reST ``::`` literal blocks into fenced code blocks (everything else, fences included, kept)."""
    out: list[str] = []
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        if _FENCE_RE.match(line):
            in_fence = not in_fence
        stripped = line.rstrip()
        if in_fence or not stripped.endswith("::"):
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        # The block: blank lines, then lines indented deeper than the paragraph, up to a line that is not.
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        k = j
        while k < len(lines) and (not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) > indent):
            k += 1
        while k > j and not lines[k - 1].strip():
            k -= 1
        if k == j:  # no indented block follows: not a literal block marker
            out.append(line)
            i += 1
            continue
        text = stripped[:-2]
        if not text.strip():
            pass  # a lone "::" introduces the block and shows nothing
        elif text.endswith((" ", "\t")):
            out.append(text.rstrip())  # "text ::" shows "text"
        else:
            out.append(text + ":")
        code = textwrap.dedent("\n".join(lines[j:k]))
        try:
            ast.parse(code)
            lang = "python"
        except SyntaxError:
            lang = "text"
        pad = " " * indent
        if out and out[-1].strip():
            out.append("")
        out.append(f"{pad}```{lang}")
        out.extend(f"{pad}{c}".rstrip() for c in code.split("\n"))
        out.append(f"{pad}```")
        i = k
    return out


def convert_docstring(text: str, owner: griffe.Object, resolver: Resolver) -> str:
    """``text`` (a docstring of ``owner``) with its Sphinx roles and ``::`` literal blocks in Markdown."""
    lines = _literal_block_lines(text.split("\n"))
    # Roles are replaced outside code blocks only; the chunks alternate prose, fenced block, prose, ...
    chunks: list[list[str]] = [[]]
    in_fence = False
    for line in lines:
        if _FENCE_RE.match(line) and not in_fence:
            in_fence = True
            chunks.append([line])
        elif _FENCE_RE.match(line) and in_fence:
            in_fence = False
            chunks[-1].append(line)
            chunks.append([])
        else:
            chunks[-1].append(line)
    parts = []
    for n, chunk in enumerate(chunks):
        if not chunk:
            continue
        joined = "\n".join(chunk)
        if n % 2 == 0:
            joined = ROLE_RE.sub(lambda m: _role_replacement(m, owner, resolver), joined)
        parts.append(joined)
    return "\n".join(parts)


def _exported(package: griffe.Module) -> set[str]:
    """The paths of the objects named in an ``__all__`` of the package, where they are defined."""
    paths = set()
    for module in iter_objects(package):
        if not module.is_module:
            continue
        for name in module.exports or ():
            member = module.members.get(name if isinstance(name, str) else name.name)
            if member is not None:
                paths.add(member.target_path if member.is_alias else member.path)
    return paths


def _document_runtime_classes(module: griffe.Module, exported: set[str], loader: griffe.GriffeLoader) -> None:
    """Replace ``module``'s exported names bound to classes made at import time by those classes.

    ``GradientScalingPlugin = _PLUGINS["GradientScalingPlugin"]`` is an attribute without a docstring to static
    analysis, so mkdocstrings would leave the class out. Only names some ``__all__`` exports and that are bound by a
    call or a subscript are candidates, and the module is imported only when it has one; a class counts if it says it
    was made here under that name.
    """
    candidates = [
        member
        for member in module.members.values()
        if member.path in exported
        and not member.is_alias
        and member.is_attribute
        and isinstance(member.value, (griffe.ExprCall, griffe.ExprSubscript))
    ]
    if not candidates:
        return
    try:
        runtime = importlib.import_module(module.path)
    except Exception as error:  # noqa: BLE001 - whatever stops the import, the pages would miss the classes
        griffe.logger.warning(
            "%s is imported to document %s, made at import time, and failed: %r (install the package and its "
            "dependencies: pip install -e '.[docs]')",
            module.path,
            ", ".join(member.name for member in candidates),
            error,
        )
        return
    for attribute in candidates:
        value = getattr(runtime, attribute.name, None)
        if not (isinstance(value, type) and value.__module__ == module.path and value.__qualname__ == attribute.name):
            continue
        cls = griffe.Class(
            attribute.name,
            lineno=attribute.lineno,
            endlineno=attribute.endlineno,
            # Shown by name, cross-referenced by path, as mkdocstrings shows the bases it reads from source.
            bases=[griffe.ExprName(base.__qualname__, parent=base.__module__) for base in value.__bases__],
        )
        if value.__doc__:
            cls.docstring = griffe.Docstring(
                inspect.cleandoc(value.__doc__),
                lineno=attribute.lineno,
                endlineno=attribute.endlineno,
                parent=cls,
                parser=loader.docstring_parser,
                parser_options=loader.docstring_options,
            )
        module.set_member(attribute.name, cls)


class SphinxRoles(griffe.Extension):
    """Rewrites each docstring of a loaded package from Sphinx markup to Markdown (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        exported = _exported(pkg)
        for module in [obj for obj in iter_objects(pkg) if obj.is_module]:
            _document_runtime_classes(module, exported, loader)
        resolver = Resolver(pkg)
        for obj in iter_objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = convert_docstring(obj.docstring.value, obj, resolver)
