"""scripts/refresh_figures.py as a module, for the tests that check the figures it writes into the docs and recipes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def refresh_figures() -> ModuleType:
    """The script's module (loaded once; its dataclasses need it registered in ``sys.modules``)."""
    if "refresh_figures" not in sys.modules:
        spec = importlib.util.spec_from_file_location("refresh_figures", REPO / "scripts" / "refresh_figures.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["refresh_figures"] = module
        spec.loader.exec_module(module)
    return sys.modules["refresh_figures"]
