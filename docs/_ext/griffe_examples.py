"""A griffe extension for the API reference: the package's docstrings as mkdocstrings renders them.

mkdocs.yml loads this file through mkdocstrings' ``extensions`` option. It changes nothing in the
package; at build time it rewrites what griffe read:

- ``Example:`` is read as ``Examples:``. The docstrings follow Lightning's habit of one
  ``Example:`` section with a doctest; griffe's Google-style parser knows only ``Examples:`` as
  the section whose ``>>>`` lines are code (under any other title ``state["model"]["w"]`` would
  be read as a Markdown link).
- Sphinx roles (``:class:`~spot_callbacks.errors.SpotError```) become code spans (``SpotError``):
  Markdown has no roles, and a cross-reference to an internal module the reference does not
  render would fail ``mkdocs build --strict``.
- ``SpotCheckpoint`` is a class built by ``spot_checkpoint_class(...)`` for each Lightning package,
  which static analysis sees as a plain attribute: it gets the class's docstring (``_DOC`` in
  ``spot_callbacks/lightning/callback.py``, or the built class's own when that moved).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from typing import Any

import griffe

_EXAMPLE_TITLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
_CLASS_DOC = "spot_callbacks.lightning.callback._DOC"


def _code_span(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def markdown_docstring(text: str) -> str:
    """``text`` with ``Example:`` titled ``Examples:`` and Sphinx roles as code spans.

    Examples:
        >>> markdown_docstring("See :class:`~a.b.C`.\\n\\nExample:\\n    >>> 1\\n    1")
        'See `C`.\\n\\nExamples:\\n    >>> 1\\n    1'
    """
    return _ROLE.sub(_code_span, _EXAMPLE_TITLE.sub(r"\1Examples:", text))


def _built_class_doc(obj: griffe.Object, loader: griffe.GriffeLoader) -> str:
    """The docstring of the class ``obj`` names: ``_DOC`` read statically, else the imported class's."""
    try:
        return str(ast.literal_eval(str(loader.modules_collection[_CLASS_DOC].value)))
    except (KeyError, ValueError, SyntaxError):  # _DOC moved or is no literal: ask the class itself
        built = getattr(importlib.import_module(obj.parent.path if obj.parent else ""), obj.name)
        return inspect.getdoc(built) or ""


class ExampleSections(griffe.Extension):
    """Rewrites each docstring with :func:`markdown_docstring` once the object tree is built."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring (docstrings are parsed lazily, after this runs)."""
        if obj.is_attribute and str(getattr(obj, "value", "")).startswith("spot_checkpoint_class("):
            obj.docstring = griffe.Docstring(_built_class_doc(obj, loader), parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Rewrite the package's own docstring (``on_object`` runs for its members only)."""
        if pkg.docstring is not None:
            pkg.docstring.value = markdown_docstring(pkg.docstring.value)
