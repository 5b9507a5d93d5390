"""Issue 28, item 6: the lines a user needs on the main path. A rerun of a finished run says it trained nothing and
how to extend it (and that advice works); ``kforge eval`` and ``kforge validate`` agree on the same split (the
recipe's ``limit_val_batches`` is why a plain ``validate`` reads a subset)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.inprocess import kforge_in_process

pytestmark = pytest.mark.slow


def _common(tmp: Path, data: Path) -> list[str]:
    return ["--config", "configs/debug.yaml", f"--data.data_dir={data}", "--data.seq_len=32", "--data.micro_batch_size=2",
            "--model.config.n_layers=1", "--model.config.dim=64", "--trainer.limit_val_batches=0",
            f"--trainer.logger.init_args.save_dir={tmp / 'runs'}", f"--trainer.callbacks.init_args.dirpath={tmp / 'ckpt'}",
            "--trainer.callbacks.init_args.every_n_train_steps=2"]  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory, shakespeare_tokens) -> Path:
    tmp = tmp_path_factory.mktemp("finished")
    proc = kforge_in_process("fit", *_common(tmp, shakespeare_tokens), "--trainer.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Checkpoint saved: {tmp / 'ckpt' / 'step=000002.ckpt'} (step 2, " in proc.stderr, proc.stderr[-3000:]
    return tmp


def test_a_rerun_of_a_finished_run_says_so_and_its_advice_extends_it(finished, shakespeare_tokens):
    common = _common(finished, shakespeare_tokens)
    proc = kforge_in_process("fit", *common, "--trainer.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = finished / "ckpt" / "step=000002.ckpt"
    line = (f"kforge: the run is already complete: {ckpt} is at step 2 and trainer.max_steps=2, so nothing was trained. "
            "To train further, raise --trainer.max_steps and keep the LR schedule with --model.scheduler.total_steps=2")  # fmt: skip
    assert line in proc.stderr, proc.stderr[-3000:]
    assert "Checkpoint saved" not in proc.stderr
    proc = kforge_in_process("fit", *common, "--trainer.max_steps=4", "--model.scheduler.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already complete" not in proc.stderr and (finished / "ckpt" / "step=000004.ckpt" / "COMPLETE").is_file()


def test_eval_equals_validate_over_the_whole_split(finished, shakespeare_tokens):
    ckpt = finished / "ckpt" / "step=000002.ckpt"
    # Without a logger Lightning writes config.yaml to default_root_dir (the working directory: the repository).
    args = ["validate", *_common(finished, shakespeare_tokens)[:-3], "--trainer.logger=false", f"--ckpt_path={ckpt}",
            f"--trainer.default_root_dir={finished}"]  # fmt: skip
    losses = {}
    for limit in ("8", "1.0"):
        proc = kforge_in_process(*args, f"--trainer.limit_val_batches={limit}")
        found = re.search(r"val/loss\s*│\s*([0-9.]+)", proc.stdout)
        assert proc.returncode == 0 and found, proc.stdout[-2000:] + proc.stderr[-2000:]
        losses[limit] = float(found.group(1))
    proc = kforge_in_process("eval", "--ckpt", str(ckpt))
    found = re.search(r"loss ([0-9.]+) nats/token", proc.stdout)
    assert proc.returncode == 0 and found, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert float(found.group(1)) == pytest.approx(losses["1.0"], rel=1e-6)  # the same windows (fp32 sum order: 3e-7)
    assert losses["8"] != pytest.approx(losses["1.0"], abs=1e-4)  # the recipe's 8 batches are a subset
