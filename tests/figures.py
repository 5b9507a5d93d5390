"""Scripts of the repository as modules (scripts/refresh_figures.py, benchmarks/estimate_published.py), for the tests that
check the figures they write into the docs and recipes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def script_module(path: str) -> ModuleType:
    """The script at ``path`` (relative to the repository) as a module named after its file, loaded once (its
    dataclasses need it registered in ``sys.modules``)."""
    name = Path(path).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def refresh_figures() -> ModuleType:
    """scripts/refresh_figures.py as a module."""
    return script_module("scripts/refresh_figures.py")
