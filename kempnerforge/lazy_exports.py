"""Package namespaces whose names are imported on first use (PEP 562 module ``__getattr__``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``package.<name>`` imports ``package.<exports[name]>`` then.

    Used where importing every submodule up front would pull heavy dependencies into processes that need one
    name (torchmetrics for a model build, Lightning for ``kforge prepare-data``).

    Args:
        package: the package's ``__name__``.
        exports: public name -> submodule (relative to ``package``) that defines it.

    Returns:
        The module-level ``__getattr__`` (raises AttributeError for other names, as a module does) and ``__dir__``.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{exports[name]}"), name)

    def __dir__() -> list[str]:
        return sorted({*vars(import_module(package)), *exports})

    return __getattr__, __dir__
