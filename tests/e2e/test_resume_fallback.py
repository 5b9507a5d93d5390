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


# Issue 28, check 4: twenty ways a checkpoint's files go bad. Each function damages one copy of the step-6
# checkpoint and returns the file a warning must name.
def _entry(ckpt: Path, rank: int, optimizer: bool, suffix: str = "") -> tuple[Path, int, int]:
    """(shard file, byte offset, length) of one model weight (or optimizer state) tensor stored in rank ``rank``'s shard."""
    storage = FileSystemReader(ckpt).read_metadata().storage_data
    for index, info in storage.items():
        is_opt = index.fqn.startswith("optimizer_0.state.")
        if is_opt == optimizer and info.relative_path == _shard(ckpt, rank).name and index.fqn.endswith(suffix):
            if info.length >= 64:
                return ckpt / info.relative_path, info.offset, info.length
    raise AssertionError(f"no {'optimizer' if optimizer else 'model'} entry in rank {rank}'s shard of {ckpt}")


def _poke(file: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(file.read_bytes())
    raw[offset : offset + len(data)] = data
    file.write_bytes(bytes(raw))
    return file


def _weight_bytes(ckpt: Path, rank: int) -> Path:
    file, offset, length = _entry(ckpt, rank, optimizer=False)
    return _poke(file, offset + length // 2, os.urandom(16))


def _flip_one_bit(ckpt: Path) -> Path:
    file, offset, _ = _entry(ckpt, 0, optimizer=False)
    byte = file.read_bytes()[offset + 3]
    return _poke(file, offset + 3, bytes([byte ^ 0x01]))  # one mantissa bit of one weight


def _optimizer_bytes(ckpt: Path, rank: int, suffix: str) -> Path:
    file, offset, length = _entry(ckpt, rank, optimizer=True, suffix=suffix)
    return _poke(file, offset + length // 2, os.urandom(16))


def _swap(a: Path, b: Path) -> tuple[Path, Path]:
    """Swap two files; either one may be named (the first one checked is)."""
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    return a, b


def _bytes_at_end(file: Path) -> Path:
    data = bytearray(file.read_bytes())
    data[-60:-40] = os.urandom(20)
    file.write_bytes(bytes(data))
    return file


def _damage_record(ckpt: Path, rank: int) -> Path:
    file = ckpt / f"checksums_{rank:05d}.json"
    body = yaml.safe_load(file.read_text())
    name = sorted(body["files"])[0]
    blocks = body["files"][name]["blocks"]
    blocks[0] = "0" * len(blocks[0])
    file.write_text(yaml.safe_dump(body))
    return file


def _stale_shard(ckpt: Path) -> Path:
    """Rank 1's shard replaced by rank 1's shard of the step-4 checkpoint (an older file, the same size)."""
    shutil.copyfile(ckpt.parent / "step=000004.ckpt" / _shard(ckpt, 1).name, _shard(ckpt, 1))
    return _shard(ckpt, 1)


TWENTY = {
    "weight_bytes_rank0": lambda c: _weight_bytes(c, 0),
    "weight_bytes_rank1": lambda c: _weight_bytes(c, 1),
    "one_weight_bit": _flip_one_bit,
    "exp_avg_bytes_rank0": lambda c: _optimizer_bytes(c, 0, "exp_avg"),
    "exp_avg_sq_bytes_rank1": lambda c: _optimizer_bytes(c, 1, "exp_avg_sq"),
    "truncated_shard_rank0": lambda c: _truncate(_shard(c, 0), 300),
    "truncated_shard_rank1_by_one_byte": lambda c: _truncate(_shard(c, 1), _shard(c, 1).stat().st_size - 1),
    "grown_shard": lambda c: (_shard(c, 0).open("ab").write(b"\0" * 8), _shard(c, 0))[1],
    "deleted_shard_rank1": lambda c: (_shard(c, 1).unlink(), _shard(c, 1))[1],
    "shards_swapped_between_ranks": lambda c: _swap(_shard(c, 0), _shard(c, 1)),
    "stale_shard_from_older_checkpoint": _stale_shard,
    "rank_files_swapped": lambda c: _swap(c / "rank_00000.pt", c / "rank_00001.pt"),
    "rank1_loop_state_bytes": lambda c: _bytes_at_end(c / "rank_00001.pt"),
    "rank0_state_truncated": lambda c: _truncate(c / "rank_00000.pt", 100),
    "meta_loop_state_bytes": lambda c: _bytes_at_end(c / "meta.pt"),
    "meta_truncated": lambda c: _truncate(c / "meta.pt", 50),
    "dcp_metadata_bytes": lambda c: _bytes_at_end(c / ".metadata"),
    "dcp_metadata_truncated": lambda c: _truncate(c / ".metadata", 40),
    "checksum_record_rank1_edited": lambda c: _damage_record(c, 1),
    "checksum_record_rank0_deleted": lambda c: ((c / "checksums_00000.json").unlink(), c / "checksums_00000.json")[1],
}


@pytest.fixture(scope="module")
def twenty_bad(reference, tmp_path_factory) -> tuple[Path, dict[str, tuple[Path, tuple[Path, ...]]]]:
    """A checkpoint folder holding the reference's intact steps 2, 4 and 6, then twenty newer damaged copies of step 6
    (one per corruption, newest first in resume order); kind -> (its checkpoint, the damaged files: any may be named)."""
    _, saved = reference
    folder = tmp_path_factory.mktemp("twenty") / "ckpt"
    shutil.copytree(saved, folder)
    shutil.rmtree(folder / f"step={STEPS:06d}.ckpt")
    base = folder / "step=000006.ckpt"
    bad: dict[str, tuple[Path, Path]] = {}
    for i, (kind, damage) in enumerate(TWENTY.items()):
        copy = folder / f"step=000006-{i:02d}-{kind}.ckpt"
        shutil.copytree(base, copy)
        damaged = damage(copy)
        bad[kind] = (copy, damaged if isinstance(damaged, tuple) else (damaged,))
        os.utime(copy, (1e9 + 10 * i, 1e9 + 10 * i))
    for old, stamp in (("step=000002.ckpt", 1e8), ("step=000004.ckpt", 2e8), ("step=000006.ckpt", 3e8)):
        os.utime(folder / old, (stamp, stamp))
    (folder / "latest").write_text(f"{copy.name}\n")
    return folder, bad


def test_check_ckpt_names_every_one_of_twenty_damaged_files_and_passes_the_intact(twenty_bad, capsys):
    from kempnerforge.tools.check_ckpt import check_ckpt

    folder, bad = twenty_bad
    assert check_ckpt(folder) == 2
    out = capsys.readouterr().out
    for kind, (ckpt, files) in bad.items():
        assert f"BAD {ckpt}\n" in out, kind
        assert any(f"  {file}: " in out for file in files), (kind, out[-3000:])
    for intact in ("step=000002.ckpt", "step=000004.ckpt", "step=000006.ckpt"):
        assert f"OK {folder / intact}\n" in out
    assert check_ckpt(folder / "step=000006.ckpt") == 0


@pytest.mark.parametrize("kind", ["weight_bytes_rank1", "exp_avg_bytes_rank0", "shards_swapped_between_ranks"])
def test_eval_generate_and_an_explicit_resume_refuse_a_damaged_checkpoint_naming_the_file(
    kind, twenty_bad, shakespeare_tokens, tmp_path
):
    from tests.conftest import GPT2_TOKENIZER as tokenizer
    from tests.e2e.inprocess import kforge_in_process

    _, bad = twenty_bad
    ckpt, files = bad[kind]
    cfg = _config(tmp_path, shakespeare_tokens)
    one_rank = yaml.safe_load(cfg.read_text())
    one_rank["trainer"]["devices"] = 1  # in this process; rank 0 then reads every shard
    cfg.write_text(yaml.safe_dump(one_rank))
    for args in (
        ["eval", "--ckpt", str(ckpt), "--data_dir", str(shakespeare_tokens)],
        ["generate", "--ckpt", str(ckpt), "--tokenizer", str(tokenizer), "--prompt", "To be", "--max_new_tokens", "2"],
        ["fit", "--config", str(cfg), "--ckpt_path", str(ckpt)],
    ):
        proc = kforge_in_process(*args)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("kforge: error:")]
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert len(lines) == 1 and any(str(f) in lines[0] for f in files), proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_auto_resume_skips_twenty_damaged_checkpoints_naming_each_file_and_resumes_the_intact_one(
    twenty_bad, reference, tmp_path, shakespeare_tokens
):
    expected, _ = reference
    folder, bad = twenty_bad
    ckpt = tmp_path / "ckpt"
    shutil.copytree(folder, ckpt)
    cfg = _config(tmp_path, shakespeare_tokens)
    text = _fit(cfg)
    for kind, (copy, files) in bad.items():
        moved = [str(ckpt / copy.name / file.relative_to(copy)) for file in files]
        warned = [
            line
            for line in text.splitlines()
            if "Auto-resume:" in line and str(ckpt / copy.name) in line and "resuming from" not in line
        ]
        assert warned and any(m in warned[0] for m in moved), (kind, "\n".join(warned) or text[-3000:])
    assert f"Auto-resume: resuming from {ckpt / 'step=000006.ckpt'}." in text, text[-4000:]
    resumed = losses(tmp_path)
    assert resumed == {s: expected[s] for s in range(6, STEPS)}


# Issue 28, check 5: what a resume may change (optimizer hyperparameters, applied and said) and what it may not (the
# global batch: one line, exit 2).
def _resume(tmp_path: Path, reference, shakespeare_tokens, *overrides: str):
    _, saved = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    for step in (6, 8):
        shutil.rmtree(ckpt / f"step={step:06d}.ckpt")
    (ckpt / "latest").write_text("step=000004.ckpt\n")
    cfg = _config(tmp_path, shakespeare_tokens)
    return run_ranks(2, SCRIPT, ["fit", "--config", str(cfg), *overrides], ENV, timeout=300)


def test_a_new_lr_and_weight_decay_on_resume_are_applied_and_logged(tmp_path, shakespeare_tokens, reference):
    _, saved = reference
    reference_lr = losses(saved.parent, "train/lr")
    proc = _resume(
        tmp_path, reference, shakespeare_tokens, "--model.optimizer.lr=1e-4", "--model.optimizer.weight_decay=0.01"
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert text.count("model.optimizer.lr: checkpoint 0.003, now 0.0001 (applied)") == 1, text[-4000:]
    assert text.count("model.optimizer.weight_decay: checkpoint 0.1, now 0.01 (applied)") == 1, text[-4000:]
    resumed_lr = losses(tmp_path, "train/lr")
    assert sorted(resumed_lr) == list(range(4, STEPS))
    for step in range(4, STEPS):  # the same place on the warmup / cosine curve, under the new peak
        assert resumed_lr[step] == pytest.approx(reference_lr[step] * (1e-4 / 3e-3), rel=1e-9), step


@pytest.mark.parametrize(
    "override, field",
    [
        ("--data.micro_batch_size=4", "data.micro_batch_size"),
        ("--trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches"),
    ],
)
def test_a_changed_global_batch_on_resume_is_one_line_exit_2(tmp_path, shakespeare_tokens, reference, override, field):
    proc = _resume(tmp_path, reference, shakespeare_tokens, override)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kforge: error:")]
    assert proc.returncode == 2, proc.stderr[-4000:]
    # Said once (both ranks refuse it), the field once, and none of Lightning's start-up lines before it.
    assert len(lines) == 1 and lines[0].startswith(f"kforge: error: {field}: "), lines
    assert lines[0].count(f"{field}: ") == 1, lines
    text = proc.stdout + proc.stderr
    for banner in ("Initializing distributed", "distributed_backend=", "Total params", "Seed set to"):
        assert banner not in text, text[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert not (tmp_path / "ckpt" / "step=000006.ckpt").exists()  # nothing trained, nothing written
    assert not (tmp_path / "runs").exists()  # the logger's folder the refused run had created is gone
