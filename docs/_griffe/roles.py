"""A griffe extension for the API reference: Sphinx roles in docstrings become Markdown.

The docstrings say ``:class:`~aioloader.PoisonBatchError``` (readable in ``help()`` and IDEs);
mkdocstrings renders Markdown, where that would show literally. A role naming an ``aioloader``
object becomes a cross-reference; any other becomes inline code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|exc|attr|mod|obj|data):`(~?)([\w.]+)`")


def _replace(match: re.Match[str]) -> str:
    short, path = match.group(1), match.group(2)
    shown = path.rsplit(".", 1)[-1] if short else path
    if path.startswith("aioloader."):
        return f"[`{shown}`][{path}]"
    return f"`{shown}`"


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_replace, obj.docstring.value)
