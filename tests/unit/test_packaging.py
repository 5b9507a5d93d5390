"""The wheel carries the top-level strategies/ and callbacks/ folders as kempnerforge subpackages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_contains_strategies_and_callbacks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("kempnerforge-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kempnerforge/strategies/__init__.py" in names
    assert "kempnerforge/strategies/kempner.py" in names
    assert "kempnerforge/callbacks/__init__.py" in names
    assert "kempnerforge/model/transformer.py" in names
    assert not any(n.startswith(("strategies/", "callbacks/", "tests/")) for n in names)
    # every package of the source tree is in the wheel (a subpackage missing from pyproject's list
    # installs fine in editable mode and breaks only for wheel users)
    packages = {p.relative_to(REPO).as_posix() for p in (REPO / "kempnerforge").rglob("__init__.py")}
    assert packages <= names, sorted(packages - names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kforge = kempnerforge.entry:console_main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_editable_install_imports_the_namespace():
    from kempnerforge.strategies import KempnerStrategy

    assert KempnerStrategy.__module__ == "kempnerforge.strategies.kempner"
    assert Path(sys.modules["kempnerforge.strategies"].__file__).parent.name == "strategies"
