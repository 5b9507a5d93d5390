"""Issue 18, check 4: the newest checkpoint is corrupt (a truncated shard, a truncated meta.pt, a deleted shard, or
an optimizer entry overwritten inside a shard, which only the load itself finds); a 2-rank ``kforge fit`` with
``--ckpt_path auto`` warns naming the bad file, resumes from the previous checkpoint on both ranks, and its losses
equal the uninterrupted run's (which a run resumed from that checkpoint reproduces exactly).

Every run is 2 ranks forked from the pre-imported forkserver (tests/distributed/forked_ranks.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml
from torch.distributed.checkpoint import FileSystemReader

from tests.distributed.forked_ranks import run_ranks
from tests.e2e.preempt_helpers import losses, write_config

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = Path(__file__).with_name("kforge_script.py")
STEPS, EVERY = 8, 2
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _config(tmp: Path, data: Path) -> Path:
    path = write_config(tmp, data)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"]["max_steps"] = STEPS
    cfg["trainer"]["callbacks"] = [c for c in cfg["trainer"]["callbacks"] if "Monitor" not in c["class_path"]]
    ckpt = next(c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))["init_args"]
    ckpt.update(every_n_train_steps=EVERY, save_top_k=-1)
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit(cfg: Path) -> str:
    proc = run_ranks(2, SCRIPT, ["fit", "--config", str(cfg)], ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def _shard(ckpt: Path, rank: int) -> Path:
    return ckpt / f"__{rank}_0.distcp"


def _overwrite_an_optimizer_entry(ckpt: Path) -> Path:
    """Zero the first bytes of one optimizer tensor's record inside its shard (size unchanged)."""
    storage = FileSystemReader(ckpt).read_metadata().storage_data
    index = next(i for i in storage if i.fqn.startswith("optimizer_0.state.") and i.fqn.endswith("exp_avg_sq"))
    info = storage[index]
    file = ckpt / info.relative_path
    data = bytearray(file.read_bytes())
    data[info.offset : info.offset + 64] = bytes(64)
    file.write_bytes(bytes(data))
    return file


def _truncate(file: Path, keep: int) -> Path:
    file.write_bytes(file.read_bytes()[:keep])
    return file


CORRUPTIONS = {
    "truncated_shard": lambda c: _truncate(_shard(c, 1), 200),
    "truncated_meta": lambda c: _truncate(c / "meta.pt", 50),
    "deleted_shard": lambda c: (_shard(c, 0).unlink(), _shard(c, 0))[1],
    "optimizer_entry_overwritten": _overwrite_an_optimizer_entry,
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shakespeare_tokens) -> tuple[dict[int, float], Path]:
    """The uninterrupted 2-rank run: losses of every step and its checkpoints (steps 2, 4, 6, 8)."""
    tmp = tmp_path_factory.mktemp("reference")
    _fit(_config(tmp, shakespeare_tokens))
    found = losses(tmp)
    assert sorted(found) == list(range(STEPS)), found
    return found, tmp / "ckpt"


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(kind, tmp_path, shakespeare_tokens, reference):
    expected, saved = reference
    cfg = _config(tmp_path, shakespeare_tokens)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    # As if the run had stopped after the step-6 save: step 6 is the newest, and it is the one that is broken.
    shutil.rmtree(ckpt / f"step={STEPS:06d}.ckpt")
    (ckpt / "latest").write_text("step=000006.ckpt\n")
    bad = CORRUPTIONS[kind](ckpt / "step=000006.ckpt")
    text = _fit(cfg)
    assert f"Auto-resume: checkpoint {ckpt / 'step=000006.ckpt'}" in text and str(bad) in text, text[-4000:]
    assert f"Auto-resume: resuming from {ckpt / 'step=000004.ckpt'}." in text, text[-4000:]
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(4, STEPS)), resumed
    assert resumed == {s: expected[s] for s in range(4, STEPS)}  # exact: fp32 CPU, same shards, RNG and data
    assert (ckpt / "latest").read_text().strip() == f"step={STEPS:06d}.ckpt"
