"""A griffe extension for the API reference: elixir's docstrings use Sphinx roles
(``:func:`~elixir.checkpoint.save```), which Markdown would show as literal text. Each role becomes a
code span (``~`` keeps only the last name, as Sphinx does)."""

from __future__ import annotations

import re

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|ref):`(~?)([^`<]+?)(?:\s*<[^`>]+>)?`")


def _replace(m: re.Match) -> str:
    tilde, target = m.group(1), m.group(2).strip()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(Extension):
    """Rewrite Sphinx cross-reference roles in every docstring into Markdown code spans."""

    def on_object(self, *, obj: Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_replace, obj.docstring.value)
