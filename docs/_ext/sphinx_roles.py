"""A Griffe extension for the API reference: the docstrings' Sphinx cross-reference roles
(``:class:`~overlap.Runtime```, ``:meth:`train_step```, ``:mod:`.wire```) become links.

The docstrings keep the Sphinx roles — they read well in the source and in ``help()`` — and
mkdocstrings does not render them, so this extension (``mkdocs.yml``: the python handler's
``extensions``) rewrites each role, in the docstring text mkdocstrings is about to render, as an
optional mkdocs-autorefs reference: ``<autoref identifier="PATH" optional><code>NAME</code>
</autoref>``. autorefs makes that a link where ``PATH`` is documented on the site, and plain
inline code ``NAME`` where it is not (a private module, the standard library) — never a
warning, never the raw role.

- ``NAME`` is the target as written, or its last component with ``~``; ``title <target>``
  shows ``title``; ``!target`` is code, never a link.
- ``PATH`` is the target as a full path: as written when it is one; else resolved in the
  docstring's own scope, as Python would see the name there (the object's members, its class,
  its module and what that module imports); a leading ``.`` is relative to the docstring's
  package.

Nothing here changes the code or its docstrings; ``tests/test_docs_render.py`` builds the site
and fails on any raw role or broken table in it.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

ROLES = ("class", "meth", "func", "mod", "data", "attr", "exc", "obj", "const")

#: A role, possibly ``:py:``-prefixed, its target possibly broken across lines.
ROLE = re.compile(r"(?<![\w`:]):(?:py:)?(?P<role>" + "|".join(ROLES) + r"):`(?P<target>[^`]+)`")
EXPLICIT = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.S)


def parse(target: str) -> tuple[str, str | None]:
    """A role's text → (what to show, the target as written, or None for no link)."""
    target = target.strip()
    if match := EXPLICIT.match(target):
        title = " ".join(match["title"].split())
        path = "".join(match["target"].split()).lstrip("~")
        return title, (None if path.startswith("!") else path)
    path = "".join(target.split())  # a dotted path broken across lines is one path
    no_link = path.startswith("!")
    path = path.lstrip("!")
    shown = path.lstrip("~")
    shown = shown.rsplit(".", 1)[-1] if path.startswith("~") else shown.lstrip(".")
    return shown, (None if no_link else path.lstrip("~"))


def rewrite(text: str, resolve: Callable[[str], str]) -> str:
    """Every role in ``text`` as an optional autoref (a link where documented, else code).

    ``resolve`` turns a target as written (``StepGraph.to_text``, ``.wire``) into a full path.
    A role broken across lines starts on the line its target continued on, so the docstring
    keeps its lines (Google-style sections are read by indentation).
    """

    def replace(match: re.Match[str]) -> str:
        shown, target = parse(match["target"])
        code = f"<code>{html.escape(shown)}</code>"
        if target is None:
            out = code
        else:
            path = resolve(target)
            out = f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'
        breaks = re.findall(r"\n[ \t]*", match["target"])
        return "".join(breaks) + out

    return ROLE.sub(replace, text)


def scope_resolver(obj: Any, collection: Any) -> Callable[[str], str]:
    """How a target in ``obj``'s docstring becomes a full path (see the module's docstring)."""

    def known(path: str) -> bool:
        try:
            collection.get_member(path)
        except Exception:  # KeyError, or an alias griffe cannot resolve yet
            return False
        return True

    def resolve(target: str) -> str:
        if target.startswith("."):
            module = obj if obj.is_module else obj.module
            package = module if module.is_package or module.is_subpackage else module.parent
            name = target.lstrip(".")
            candidates = []
            while package is not None:
                candidates.append(f"{package.path}.{name}")
                package = package.parent
            return next((c for c in candidates if known(c)), candidates[0] if candidates else name)
        if "." in target and known(target):
            return target
        head, _, rest = target.partition(".")
        try:
            path = obj.resolve(head)
        except Exception:  # NameResolutionError: not a name in that scope (a full path, stdlib)
            return target
        return f"{path}.{rest}" if rest else path

    return resolve


try:
    from griffe import Extension
except ImportError:  # (only the rewriting above is used without griffe)
    Extension = object  # type: ignore[assignment,misc]


class SphinxRoles(Extension):  # type: ignore[misc,valid-type]
    """Rewrite the Sphinx roles of every docstring griffe loads (see the module's docstring)."""

    def _rewrite(self, obj: Any, loader: Any) -> None:
        if obj.is_alias or obj.docstring is None or ":" not in obj.docstring.value:
            return
        obj.docstring.value = rewrite(
            obj.docstring.value, scope_resolver(obj, loader.modules_collection))

    def on_object(self, *, obj: Any, loader: Any, **kwargs: Any) -> None:
        self._rewrite(obj, loader)

    def on_package(self, *, pkg: Any, loader: Any, **kwargs: Any) -> None:
        self._rewrite(pkg, loader)  # (on_object runs on members only)
