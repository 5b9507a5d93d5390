"""Rank script of issue 30, check 5 (second half): which checkpoint files each rank opens during a restore.

One launch on 4 gloo ranks (``KempnerStrategy(dp_shard=4)``, the tiny decoder of ``train_script``):

1. ``Trainer.fit`` for 3 steps, a checkpoint after every step (``step=1`` .. ``step=3``).
2. Rank 0 overwrites 64 bytes in the middle of rank 3's shard of ``step=3`` (same size: only its checksum, read by
   rank 3, can tell).
3. ``Trainer.fit`` to step 4 with ``--ckpt_path auto`` (:class:`AutoResume`): the restore of ``step=3`` fails on
   rank 3 and is rejected on every rank, ``step=2`` is restored. Every ``open`` of a file under the checkpoint folder
   (``builtins.open``, ``io.open``, ``os.open``) inside ``KempnerStrategy.load_checkpoint`` is recorded per rank,
   with the bytes each rank reads to verify (verified shard reads, whole-file checks).

Rank 0 writes ``{"opened": [per rank: sorted relative paths], "bytes": [per rank: {relative path: bytes read to
verify}], "sizes": {relative path: bytes}, "rejected": {path: reason}, "resumed_from", "resumed_step"}`` as JSON to
``--out``.
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.* under torchrun
from kempnerforge.data.datamodule import TokenDataModule  # noqa: E402
from kempnerforge.module import CausalLM  # noqa: E402
from kempnerforge.resilience.auto_resume import AutoResume  # noqa: E402
from kempnerforge.strategies import KempnerStrategy  # noqa: E402
from kempnerforge.training.lr import SchedulerConfig  # noqa: E402
from kempnerforge.training.optimizers import OptimizerConfig  # noqa: E402
from tests.distributed.train_script import tiny_config  # noqa: E402


def _fit(data: str, folder: Path, steps: int, ckpt_path=None) -> Trainer:
    seed_everything(0, workers=True)
    module = CausalLM(config=tiny_config(), optimizer=OptimizerConfig(lr=3e-3),
                      scheduler=SchedulerConfig(warmup_steps=2, total_steps=10), grad_clip=1.0)  # fmt: skip
    datamodule = TokenDataModule(data_dir=data, seq_len=32, micro_batch_size=2, val_fraction=0.1, data_seed=0)
    saves = ModelCheckpoint(dirpath=folder, filename="step={step}", every_n_train_steps=1, save_top_k=-1,
                            auto_insert_metric_name=False)  # fmt: skip
    trainer = Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=KempnerStrategy(dp_shard=4),
                      max_steps=steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[saves])  # fmt: skip
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def _record_reads(folder: Path, opened: set[str], nbytes: dict[str, int]):
    """Wrap ``KempnerStrategy.load_checkpoint`` so that every open of a file under ``folder`` during it lands in
    ``opened`` (relative paths), and the bytes read for verification in ``nbytes`` (``os.preadv``, which verified
    shard reads use, and whole-file checks); returns an undo function."""
    from kempnerforge.checkpoint import checksum

    real = {"builtins": builtins.open, "io": io.open, "os": os.open, "preadv": os.preadv, "pieces": checksum._pieces}
    root = str(folder.resolve())

    def rel(path) -> str | None:
        text = str(Path(os.fspath(path)).resolve()) if isinstance(path, str | os.PathLike) else ""
        return os.path.relpath(text, root) if text.startswith(root + os.sep) else None

    def note(path) -> None:
        if (name := rel(path)) is not None:
            opened.add(name)

    def count(path, n: int) -> None:
        if (name := rel(path)) is not None:
            nbytes[name] = nbytes.get(name, 0) + n

    def counting_open(file, *args, **kwargs):
        note(file)
        return real["builtins"](file, *args, **kwargs)

    def counting_os_open(path, *args, **kwargs):
        note(path)
        return real["os"](path, *args, **kwargs)

    def counting_preadv(fd, buffers, offset, *args):
        n = real["preadv"](fd, buffers, offset, *args)
        count(os.readlink(f"/proc/self/fd/{fd}"), n)
        return n

    def counting_pieces(file):
        for piece in real["pieces"](file):
            count(file, len(piece))
            yield piece

    load = KempnerStrategy.load_checkpoint

    def load_checkpoint(self, *args, **kwargs):
        builtins.open = io.open = counting_open
        os.open, os.preadv, checksum._pieces = counting_os_open, counting_preadv, counting_pieces
        try:
            return load(self, *args, **kwargs)
        finally:
            builtins.open, io.open, os.open = real["builtins"], real["io"], real["os"]
            os.preadv, checksum._pieces = real["preadv"], real["pieces"]

    KempnerStrategy.load_checkpoint = load_checkpoint
    return lambda: setattr(KempnerStrategy, "load_checkpoint", load)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    folder = Path(args.root) / "ckpt"
    _fit(args.data, folder, steps=3)
    if dist.get_rank() == 0:
        shard = folder / "step=3.ckpt" / "__3_0.distcp"
        data = bytearray(shard.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        shard.write_bytes(bytes(data))
    dist.barrier()
    opened: set[str] = set()
    nbytes: dict[str, int] = {}
    undo = _record_reads(folder, opened, nbytes)
    auto = AutoResume(folder)
    trainer = _fit(args.data, folder, steps=4, ckpt_path=auto)
    undo()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"opened": sorted(opened), "bytes": nbytes})
    if dist.get_rank() == 0:
        restored = trainer.strategy.restored
        sizes = {str(f.relative_to(folder)): f.stat().st_size for f in folder.rglob("*") if f.is_file()}
        record = {"opened": [r["opened"] for r in everyone], "bytes": [r["bytes"] for r in everyone], "sizes": sizes,
                  "rejected": {str(k): v for k, v in auto.rejected.items()}, "resumed_from": str(restored[0]),
                  "resumed_step": restored[1]}  # fmt: skip
        Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
