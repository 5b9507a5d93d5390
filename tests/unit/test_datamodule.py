"""TokenDataModule: global-batch invariance across dp sizes, resumable loaders, auto-prepare, errors."""

import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from kempnerforge.data.datamodule import ResumableDistributedSampler, TokenDataModule
from kempnerforge.data.memmap import MemmapTokenDataset
from kempnerforge.data.prepare import prepare_data

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "data" / "tokenizers" / "gpt2"
SHAKESPEARE = REPO / "data" / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "shakespeare.txt"
    path.write_text(SHAKESPEARE.read_text()[:20_000])  # 6048 GPT-2 tokens
    return path


@pytest.fixture(scope="module")
def prepared(source) -> Path:
    out = source.parent / "tokens"
    prepare_data(str(source), str(TOKENIZER), str(out), progress=False)
    return out


class Indices(Dataset):
    """Item i is i: batches show exactly which windows a sampler picked."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def loader(n: int, batch: int, replicas: int = 1, rank: int = 0, workers: int = 0, seed: int = 7):
    sampler = ResumableDistributedSampler(
        Indices(n), num_replicas=replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    dl = StatefulDataLoader(Indices(n), batch_size=batch, sampler=sampler, drop_last=True, num_workers=workers)
    return dl, sampler


def epoch_batches(n: int, batch: int, replicas: int = 1, rank: int = 0, epoch: int = 0) -> list[list[int]]:
    dl, sampler = loader(n, batch, replicas, rank)
    sampler.set_epoch(epoch)
    return [b.tolist() for b in dl]


@pytest.mark.parametrize("epoch", [0, 3])
def test_global_batch_is_invariant_to_dp_size(epoch):
    """One process at micro-batch 8 sees, step by step, the union of 2 ranks at 4 (and 4 ranks at 2)."""
    single = epoch_batches(103, 8, epoch=epoch)
    for replicas, micro in ((2, 4), (4, 2)):
        ranks = [epoch_batches(103, micro, replicas, r, epoch) for r in range(replicas)]
        for step, batch in enumerate(single):
            assert sorted(batch) == sorted(i for r in ranks for i in r[step])
        assert all(len(r) == len(single) for r in ranks)


def test_ranks_are_disjoint_and_cover_the_epoch():
    ranks = [sum(epoch_batches(103, 4, 2, r), []) for r in range(2)]
    assert not set(ranks[0]) & set(ranks[1])
    assert len(ranks[0]) == len(ranks[1]) == 48  # 103 // 2 = 51 per rank, 12 full batches of 4
    assert len(set(ranks[0] + ranks[1])) == 96
    assert epoch_batches(103, 4, 2, 0, epoch=1) != epoch_batches(103, 4, 2, 0, epoch=0)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_loader_resumes_mid_epoch_and_across_epochs(workers):
    ref, ref_sampler = loader(60, 4)
    ref_sampler.set_epoch(1)
    epoch1 = [b.tolist() for b in ref]
    ref_sampler.set_epoch(2)
    epoch2 = [b.tolist() for b in ref]
    epoch3 = [b.tolist() for b in ref]  # the sampler moves on by itself after a whole epoch

    dl, sampler = loader(60, 4, workers=workers)
    sampler.set_epoch(1)
    it = iter(dl)
    first = [next(it).tolist() for _ in range(5)]
    state = dl.state_dict()
    # A fresh loader (sampler at epoch 0) continues with batch 6 of epoch 1; Lightning's order
    # (iter, then set_epoch) and no set_epoch at all both work because the state holds the epoch.
    fresh, fresh_sampler = loader(60, 4, workers=workers)
    fresh.load_state_dict(state)
    it = iter(fresh)
    fresh_sampler.set_epoch(1)
    assert first + [b.tolist() for b in it] == epoch1
    fresh, _ = loader(60, 4, workers=workers)
    fresh.load_state_dict(state)
    assert first + [b.tolist() for b in fresh] == epoch1
    # A state saved at the end of epoch 1 (as Lightning saves it: after the last batch, before the iterator has raised
    # StopIteration) resumes at the start of epoch 2, whichever epoch Lightning sets next: 1 (its counter lags after a
    # restart at an epoch's end) or 2; and the epoch after it is 3.
    done, done_sampler = loader(60, 4, workers=workers)
    done_sampler.set_epoch(1)
    it = iter(done)
    assert [next(it).tolist() for _ in epoch1] == epoch1
    state = done.state_dict()
    for lightning_epoch in (1, 2):
        nxt, nxt_sampler = loader(60, 4, workers=workers)
        nxt.load_state_dict(state)
        nxt_sampler.set_epoch(lightning_epoch)
        assert [b.tolist() for b in nxt] == epoch2
        nxt_sampler.set_epoch(lightning_epoch + 1)
        assert [b.tolist() for b in nxt] == epoch3


class Recorder(L.LightningModule):
    """Tiny model that records the first token of every training sample it is fed."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50304, 2)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"][:, 0].tolist())
        return self.emb(batch["input_ids"]).mean()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_resume_mid_second_epoch_is_exact(prepared, tmp_path):
    """Through a real Trainer checkpoint: steps 27..40 after resuming equal the uninterrupted run.

    With a plain DistributedSampler this fails: Lightning builds the iterator before set_epoch on
    restore, so epoch 1 would be replayed in epoch 0's order.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(model, steps, **kw):
        dm = TokenDataModule(str(prepared), seq_len=64, micro_batch_size=4, val_fraction=0.1, vocab_size=50304)
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=1,
            default_root_dir=tmp_path,
            **{k: v for k, v in kw.items() if k != "ckpt_path"},
        )
        trainer.fit(model, dm, ckpt_path=kw.get("ckpt_path"))
        return trainer

    ref = Recorder()
    trainer = fit(ref, 40)  # 20 steps per epoch: two epochs
    assert trainer.current_epoch == 2 and isinstance(trainer.train_dataloader.sampler, ResumableDistributedSampler)
    first = Recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=27, save_top_k=-1)
    fit(first, 27, callbacks=[ckpt])
    resumed = Recorder()
    fit(resumed, 40, ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=27.ckpt"))
    assert first.seen + resumed.seen == ref.seen


class StopAt(L.Callback):
    """Save and stop at ``step`` the way ``Preemption`` does (``trainer.should_stop`` in ``on_train_batch_end``)."""

    def __init__(self, step: int, path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


@pytest.mark.parametrize(
    "stop, workers, micro_batch",
    [("max_steps", 0, 12), ("max_steps", 2, 12), ("should_stop", 0, 12), ("should_stop", 2, 12),
     ("max_steps", 0, 10), ("max_steps", 2, 10), ("should_stop", 0, 10), ("should_stop", 2, 10)],
)  # fmt: skip
def test_lightning_resumes_twice_at_epoch_ends_exactly(prepared, tmp_path, workers, stop, micro_batch):
    """Checkpoints after an epoch's last batch (84 training windows: 7 steps of 12, or 8 steps of 10 with the last 4
    windows dropped), resumed, and the resumed run's own epoch-end checkpoint resumed again: every step's samples
    equal the uninterrupted run's. Lightning's epoch counter lags the data after such a restart; a sampler that
    obeyed it replayed an epoch at the second resume (workers 0) or skipped one at the first (workers 2, which draw
    indices when the iterator is built). With a dropped remainder the checkpoint holds a position short of the
    epoch's end: the resumed loader hands out those 4 windows, drops them as the partial batch and starts the next
    epoch."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    per_epoch = 84 // micro_batch

    def fit(model, steps, ckpt_path=None, folder="ckpt"):
        callbacks = [ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=per_epoch, save_top_k=-1)]
        if stop == "should_stop" and steps < 3 * per_epoch:
            callbacks, steps = [StopAt(steps, tmp_path / folder / f"stop-step={steps}.ckpt")], 100
        dm = TokenDataModule(str(prepared), seq_len=64, micro_batch_size=micro_batch, val_fraction=0.1,
                             vocab_size=50304, num_workers=workers)  # fmt: skip
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                            default_root_dir=tmp_path, callbacks=callbacks)  # fmt: skip
        trainer.fit(model, dm, ckpt_path=ckpt_path)

    ref = Recorder()
    fit(ref, 3 * per_epoch, folder="reference")
    epochs = [ref.seen[i * per_epoch : (i + 1) * per_epoch] for i in range(3)]
    assert len({tuple(batch) for batch in epochs[0]}) == per_epoch and epochs[0] != epochs[1] != epochs[2]
    runs = [Recorder(), Recorder(), Recorder()]
    fit(runs[0], per_epoch)
    (first,) = (tmp_path / "ckpt").glob(f"*step={per_epoch}.ckpt")
    fit(runs[1], 2 * per_epoch, ckpt_path=str(first))
    (second,) = (tmp_path / "ckpt").glob(f"*step={2 * per_epoch}.ckpt")
    fit(runs[2], 3 * per_epoch, ckpt_path=str(second))
    assert [len(r.seen) for r in runs] == [per_epoch] * 3
    assert sum((r.seen for r in runs), []) == ref.seen


def test_setup_split_sizes_and_batches(prepared):
    dm = TokenDataModule(str(prepared), seq_len=64, micro_batch_size=4, val_fraction=0.1, data_seed=1)
    dm.setup("fit")
    n = (6048 - 1) // 64  # one shard
    assert len(dm.train_dataset) + len(dm.val_dataset) == n == 94
    assert len(dm.val_dataset) == math.ceil(0.1 * n) == 10
    whole = MemmapTokenDataset(prepared, 64)  # validation holds the last windows
    assert [dm.val_dataset[i]["input_ids"].tolist() for i in (0, 9)] == [
        whole[84]["input_ids"].tolist(),
        whole[93]["input_ids"].tolist(),
    ]
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 64) and batch["input_ids"].dtype == torch.long
    assert len(dm.train_dataloader()) == 84 // 4
    val = dm.val_dataloader()
    assert len(val) == 3 and [b["input_ids"].shape[0] for b in val] == [
        4,
        4,
        2,
    ]  # validation keeps every window
    assert dm.tokens_per_batch == 256
    assert not dm.train_dataloader().pin_memory  # no CUDA here


def test_val_fraction_zero_disables_validation(prepared):
    dm = TokenDataModule(str(prepared), seq_len=64, val_fraction=0.0)
    dm.setup("fit")
    assert len(dm.train_dataset) == 94 and dm.val_dataloader() == []


def test_dp_rank_and_size_come_from_the_strategy(prepared):
    dm = TokenDataModule(str(prepared), seq_len=64, micro_batch_size=4)
    assert dm.dp_rank_and_size() == (0, 1)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1}))
    sampler = dm.train_dataloader().sampler
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.drop_last) == (2, 1, True, True)
    assert dm.val_dataloader().sampler.shuffle is False


def test_prepare_data_hook_tokenizes_source(source, tmp_path):
    data_dir = tmp_path / "auto"
    data_dir.mkdir()
    (data_dir / "shard_00007.npy").write_bytes(b"left over by a crashed run")
    dm = TokenDataModule(str(data_dir), seq_len=64, source=str(source), tokenizer=str(TOKENIZER))
    dm.prepare_data()
    assert sorted(p.name for p in data_dir.iterdir()) == [".prepare", "metadata.json", "shard_00000.npy"]
    mtime = (data_dir / "metadata.json").stat().st_mtime_ns
    dm.prepare_data()  # already prepared: a no-op
    assert (data_dir / "metadata.json").stat().st_mtime_ns == mtime
    dm.setup("fit")
    assert len(dm.train_dataset) + len(dm.val_dataset) == 94


def test_prepare_data_hook_refuses_foreign_files(source, tmp_path):
    (tmp_path / "mine.txt").write_text("not ours")
    dm = TokenDataModule(str(tmp_path), source=str(source), tokenizer=str(TOKENIZER))
    with pytest.raises(FileExistsError, match="is not empty"):
        dm.prepare_data()


def test_setup_errors(prepared, tmp_path):
    with pytest.raises(ValueError, match=r"has 1 windows of seq_len \+ 1 = 4001 tokens: too few for val_fraction"):
        TokenDataModule(str(prepared), seq_len=4000).setup("fit")
    dm = TokenDataModule(str(prepared), seq_len=64, micro_batch_size=64, val_fraction=0.1)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0}))
    with pytest.raises(
        ValueError, match=r"train split .* has 84 windows .* fewer than one global batch of .* 64 \* 2 = 128"
    ):
        dm.setup("fit")
    with pytest.raises(FileNotFoundError, match="run `kforge prepare-data` first"):
        TokenDataModule(str(tmp_path / "none")).setup("fit")
    with pytest.raises(ValueError, match=r"vocab_size=50257 .* model's vocab_size=32000"):
        TokenDataModule(str(prepared), vocab_size=32000).setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 0}, "seq_len must be a positive integer, got 0"),
        ({"micro_batch_size": -1}, "micro_batch_size must be a positive integer, got -1"),
        ({"val_fraction": 1.0}, r"val_fraction must be in \[0, 1\), got 1.0"),
        ({"num_workers": -1}, "num_workers must be >= 0"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"source": "x.txt"}, "source and tokenizer go together"),
    ],
)
def test_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenDataModule("unused", **kwargs)


def test_the_sampler_owns_its_epoch_and_set_epoch_only_moves_it_forward():
    """After a whole epoch the sampler is in the next one; a set_epoch that goes back (Lightning's lagging counter after
    a restart at an epoch's end) is ignored, a later one starts that epoch at its first index."""
    ref, ref_sampler = loader(60, 4)
    epochs = [[b.tolist() for b in ref] for _ in range(4)]
    assert ref_sampler.epoch == 3 and len({str(e) for e in epochs}) == 4  # four different permutations
    dl, sampler = loader(60, 4)
    sampler.load_state_dict({"yielded": 8, "epoch": 1})
    sampler.set_epoch(0)  # back: ignored, the position holds
    assert [b.tolist() for b in dl] == epochs[1][2:]
    sampler.load_state_dict({"yielded": 8, "epoch": 1})
    sampler.set_epoch(3)  # forward: epoch 3 from its start
    assert [b.tolist() for b in dl] == epochs[3]
