"""A griffe extension for the API pages: the docstrings' reStructuredText roles and literals (``:class:`~a.B```,
````x````) rendered as Markdown code, since mkdocstrings reads docstrings as Markdown."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc|ref):`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def markdown(text: str) -> str:
    """``text`` with each role as inline code (``~a.b.C`` keeps ``C``, as Sphinx shows it) and each double-backtick
    literal as single-backtick code."""
    text = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return _LITERAL.sub(r"`\1`", text)


class RstRoles(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
