"""Every Lightning / torchmetrics method our classes override carries ``@override`` (typing_extensions), as
Lightning's own code does: a hook renamed upstream then fails type checking instead of silently never running."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import kempnerforge
import kempnerforge.callbacks
import kempnerforge.strategies

#: Third-party packages whose classes we subclass and whose methods therefore need ``@override``.
FRAMEWORKS = ("lightning", "torchmetrics")


def _modules():
    names = {"kempnerforge.strategies", "kempnerforge.callbacks"}
    for pkg in (kempnerforge, kempnerforge.strategies, kempnerforge.callbacks):
        names.update(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
    return [importlib.import_module(n) for n in sorted(names)]


def missing_overrides() -> list[str]:
    """``module.Class.method`` for each method defined on one of our classes that also exists on a framework
    base class of it but is not marked ``@override`` (properties: their getter)."""
    missing, seen = [], set()
    for mod in _modules():
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ != mod.__name__ or cls in seen:
                continue
            seen.add(cls)
            bases = [b for b in cls.__mro__[1:] if b.__module__.startswith(FRAMEWORKS)]
            for attr, value in vars(cls).items():
                if attr.startswith("__") or attr == "_abc_impl" or not any(attr in vars(b) for b in bases):
                    continue
                func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if callable(func) and not getattr(func, "__override__", False):
                    missing.append(f"{cls.__module__}.{cls.__qualname__}.{attr}")
    return missing


def test_every_framework_override_is_marked():
    assert missing_overrides() == []


def test_the_check_sees_strategies_and_callbacks():
    from kempnerforge.callbacks import NaNGuard
    from kempnerforge.strategies import KempnerStrategy

    assert KempnerStrategy.setup.__override__ and NaNGuard.on_train_start.__override__
