"""Issue 29, check 6: a new user, given only the site, reaches a trained, exported and evaluated model on this machine
by following the pretraining tutorial (then fine-tunes it on chat data), with no command that fails as written.

The ``On this machine (CPU)`` blocks of docs/tutorials/pretrain.md and finetune-chat.md run in order, as written, in a
fresh folder whose configs/ and data/ are the repository's: each ``kforge`` command in-process (tests/e2e/inprocess.py:
the same ``kempnerforge.cli.main`` the console script runs), every other line (``cp``, heredocs, a Python snippet) by
bash. What the pages say each step prints is checked on its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_commands import CPU_TITLE, REPO, blocks, kforge_argv
from tests.e2e.inprocess import kforge_in_process

pytestmark = pytest.mark.slow


def cpu_steps(page: Path) -> list[tuple[str, object]]:
    """The CPU blocks of ``page`` as steps: ``("kforge", argv)`` or ``("bash", script)``, in page order."""
    steps: list[tuple[str, object]] = []
    for block in blocks(page.read_text()):
        if block.title != CPU_TITLE:
            continue
        lines, i, script = block.text.splitlines(), 0, []
        while i < len(lines):
            line = lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            argv = kforge_argv(line) if line.startswith("kforge ") else None
            if argv is not None:
                if script:
                    steps.append(("bash", "\n".join(script)))
                    script = []
                steps.append(("kforge", argv))
            else:
                script.append(line)
                heredoc = re.search(r"<<-?\s*'?(\w+)'?", line)
                while heredoc and i + 1 < len(lines):
                    i += 1
                    script.append(lines[i])
                    if lines[i].strip() == heredoc.group(1):
                        break
            i += 1
        if script:
            steps.append(("bash", "\n".join(script)))
    return steps


def run_page(page: Path, cwd: Path) -> list[tuple[list[str], str]]:
    """Run every step of ``page``'s CPU blocks in ``cwd``; ``(argv, output)`` of each kforge command."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = []
    for kind, step in cpu_steps(page):
        if kind == "bash":
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", step], cwd=cwd, env=env, capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
            assert proc.returncode == 0, (step, proc.stdout[-2000:], proc.stderr[-2000:])
            continue
        proc = kforge_in_process(*step, cwd=cwd)
        assert proc.returncode == 0, (f"{page.name}: kforge {' '.join(step)}", proc.stdout[-3000:], proc.stderr[-5000:])
        outputs.append((step, proc.stdout + proc.stderr))
    return outputs


def _output(outputs, *prefix: str) -> list[str]:
    return [out for argv, out in outputs if argv[: len(prefix)] == list(prefix)]


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A folder a user would work in: configs/ and data/ as the repository's (data/tokens/ is new)."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "data").mkdir()
    for entry in (REPO / "data").iterdir():
        if entry.name != "tokens":
            (tmp_path / "data" / entry.name).symlink_to(entry)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    return tmp_path


def test_pretraining_then_fine_tuning_tutorials_run_as_written(workdir):
    pre = run_page(REPO / "docs" / "tutorials" / "pretrain.md", workdir)
    assert [argv[0] for argv, _ in pre] == ["prepare-data", "estimate", "fit", "fit", "check-ckpt", "convert", "eval",
                                            "generate"]  # fmt: skip
    first, resumed = _output(pre, "fit")
    assert "Checkpoint saved:" in first and "step=000010.ckpt" in first
    assert re.search(r"Auto-resume: resuming from \S*checkpoints/shakespeare/step=000010\.ckpt", resumed), resumed[
        -3000:
    ]
    assert (workdir / "checkpoints" / "shakespeare" / "latest").read_text().strip() == "step=000020.ckpt"
    # the quick start (run first by most readers) leaves its checkpoints in the recipe's folder: the tutorial's runs
    # must not resume from them (a different global batch and LR schedule: refused)
    assert not (workdir / "checkpoints" / "debug").exists()
    assert "fits" in _output(pre, "estimate")[0]
    assert (workdir / "hf" / "debug" / "config.json").is_file() and (
        workdir / "hf" / "debug" / "model.safetensors"
    ).is_file()
    (evaluated,) = _output(pre, "eval")
    ppl = float(re.search(r"perplexity ([0-9.]+)", evaluated).group(1))
    assert 1 < ppl < 50257, evaluated  # better than chance after 20 steps
    assert "generated 20 tokens" in _output(pre, "generate")[0]

    sft = run_page(REPO / "docs" / "tutorials" / "finetune-chat.md", workdir)
    assert [argv[0] for argv, _ in sft] == ["prepare-data", "fit", "convert", "generate", "eval"]
    assert "1,000 conversations" in _output(sft, "prepare-data")[0]
    (tuned,) = _output(sft, "fit")
    assert "init_from: loaded" in tuned and "hf/debug-chat" in tuned and "chat data:" in tuned
    assert (workdir / "hf" / "debug-sft" / "chat_template.jinja").is_file()
    assert "perplexity" in _output(sft, "eval")[0]
