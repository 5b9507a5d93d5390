"""Streaming HF datasets: windows equal the eager (prepared) path, rank/worker sharding, exact resume."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from kempnerforge.data.hf_dataset import PackedTokenStream
from kempnerforge.data.memmap import MemmapTokenDataset
from kempnerforge.data.prepare import load_tokenizer, prepare_data
from kempnerforge.data.sources import check_dataset_spec
from kempnerforge.data.streaming import StreamingTokenDataModule

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated", "ignore:.*does not have many workers")

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = str(REPO / "data" / "tokenizers" / "gpt2")
SHAKESPEARE = REPO / "data" / "tinyshakespeare" / "input.txt"
SEQ = 32


@pytest.fixture(scope="module")
def rows() -> list[str]:
    """First 120 paragraphs of Shakespeare (real text), one document each."""
    return [p for p in SHAKESPEARE.read_text()[:30_000].split("\n\n") if p.strip()][:120]


@pytest.fixture(scope="module")
def spec(rows, tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("stream") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return {"path": "json", "data_files": str(path)}


@pytest.fixture(scope="module")
def proto(spec) -> PackedTokenStream:
    """One stream built once (load_dataset is the slow part); tests deep-copy it for fresh readers."""
    return PackedTokenStream(spec, TOKENIZER, SEQ)


def stream(proto: PackedTokenStream, **attrs) -> PackedTokenStream:
    s = copy.deepcopy(proto)
    for k, v in attrs.items():
        setattr(s, k, v)
    return s


def expected_windows(rows: list[str]) -> list[list[int]]:
    """Oracle: every row's tokens + EOS, concatenated, cut into seq+1 windows with stride seq."""
    tok = load_tokenizer(TOKENIZER)
    flat = [i for ids in tok.encode_batch(rows) for i in ids + [tok.eos_id]]
    return [flat[s : s + SEQ + 1] for s in range(0, len(flat) - SEQ, SEQ)]


def windows(samples) -> list[list[int]]:
    return [s["input_ids"].tolist() + s["labels"][-1:].tolist() for s in samples]


def test_one_pass_equals_eager_prepared_shards(proto, spec, rows, tmp_path):
    """The streamed windows are exactly the memmap windows of the same spec prepared eagerly."""
    got = windows(stream(proto, repeat=False))
    prepare_data(spec, TOKENIZER, str(tmp_path / "tok"), progress=False)
    eager = MemmapTokenDataset(tmp_path / "tok", SEQ)
    assert got == windows(eager[i] for i in range(len(eager))) == expected_windows(rows)
    assert len(got) > 100


@pytest.mark.parametrize(("dp", "workers"), [(2, 0), (2, 2)])
def test_sharded_across_ranks_and_workers(proto, rows, dp, workers):
    """Reader ``rank * workers + w`` packs exactly rows ``[reader::dp*workers]`` (one file: row-level split)."""
    readers = dp * max(workers, 1)
    for rank in range(dp):
        dl = StatefulDataLoader(
            stream(proto, dp_rank=rank, dp_size=dp, repeat=False), batch_size=1, num_workers=workers
        )
        got = windows({k: v[0] for k, v in b.items()} for b in dl)
        mine = [expected_windows(rows[rank * max(workers, 1) + w :: readers]) for w in range(max(workers, 1))]
        # Workers take batches in turn until one runs out; then the other continues.
        assert sorted(got) == sorted(w for ws in mine for w in ws)
        assert got[: 2 * min(map(len, mine))] == [ws[i] for i in range(min(map(len, mine))) for ws in mine]


def batches(dl, n: int, it=None) -> tuple[list[list[list[int]]], object]:
    it = iter(dl) if it is None else it
    return [next(it)["input_ids"].tolist() for _ in range(n)], it


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resume_is_exact_twice_and_across_passes(proto, workers):
    """Uninterrupted 60 batches (the source holds ~32 per reader: the seam to the second pass is crossed)
    equal 17 + resume + 20 + resume + 23 batches, each resume a fresh loader from the saved state."""

    def loader():
        return StatefulDataLoader(stream(proto), batch_size=4, num_workers=workers, persistent_workers=workers > 0)

    ref, _ = batches(loader(), 60)
    got, state = [], None
    for n in (17, 20, 23):
        dl = loader()
        if state is not None:
            dl.load_state_dict(state)
        part, _ = batches(dl, n)
        got += part
        state = dl.state_dict()
    assert got == ref
    if workers == 0:
        assert state["dataset_state"]["pass"] == 1  # the last resume continued inside the second pass


class Recorder(L.LightningModule):
    """Records every training batch's ids."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50304, 2)
        self.seen: list[list[list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].tolist())
        return self.emb(batch["input_ids"]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_checkpoint_resume_is_exact(spec, tmp_path):
    """Through Trainer checkpoints (workers=2): 0..7, resume 7..15, resume 15..24 equal one 24-step run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(model, steps, ckpt_path=None, every=None):
        dm = StreamingTokenDataModule(spec, TOKENIZER, seq_len=SEQ, micro_batch_size=4, num_workers=2)
        cbs = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)] if every else []
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=bool(every),
            default_root_dir=tmp_path,
            callbacks=cbs,
        )
        trainer.fit(model, dm, ckpt_path=ckpt_path)

    ref = Recorder()
    fit(ref, 24)
    legs = [Recorder() for _ in range(3)]
    fit(legs[0], 7, every=7)
    fit(legs[1], 15, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=7.ckpt"), every=15)
    fit(legs[2], 24, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=15.ckpt"))
    assert sum((leg.seen for leg in legs), []) == ref.seen and len(ref.seen) == 24


def test_validation_batches_are_fixed_per_rank(spec):
    dm = StreamingTokenDataModule(spec, TOKENIZER, seq_len=SEQ, micro_batch_size=4, val_source=spec, val_batches=3)
    val = [b["input_ids"] for b in dm.val_dataloader()]
    assert len(val) == 3 and all(v.shape == (4, SEQ) for v in val)
    assert StreamingTokenDataModule(spec, TOKENIZER).val_dataloader() == []


def test_document_masking_adds_doc_ids(proto):
    sample = next(iter(stream(proto, document_masking=True)))
    assert sample["doc_ids"].shape == (SEQ,) and (sample["labels"][sample["input_ids"] == 50256] == -100).all()


def test_empty_reader_is_refused(proto, tmp_path):
    with pytest.raises(ValueError, match="got no rows of the source"):
        next(iter(stream(proto, dp_rank=150, dp_size=151)))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"path": "someone/hub-dataset"}, "neither a local builder"),
        ({"path": "json", "data_files": "/nonexistent/*.jsonl"}, "matches no local file"),
        ({"path": "json"}, "needs data_files or data_dir"),
        ({"path": "json", "data_files": "x", "streaming": True}, "streaming is set by the data module"),
        ("corpus.jsonl", "must be a dict"),
    ],
)
def test_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        check_dataset_spec(spec)


def test_module_errors(spec):
    with pytest.raises(ValueError, match="micro_batch_size=0 must be a positive integer"):
        StreamingTokenDataModule(spec, TOKENIZER, micro_batch_size=0)
    with pytest.raises(ValueError, match=r"vocab_size=50257 > the model's vocab_size=1000"):
        StreamingTokenDataModule(spec, TOKENIZER, vocab_size=1000)


# -- issue 30 item 2: paths as sources, mixtures, the checks before the rendezvous ------------------------------------


def test_paths_stream_like_their_specs(rows, spec, tmp_path):
    """A jsonl file, a folder of parquet files and a .txt file given as paths stream the windows of the same data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kempnerforge.data.sources import path_spec

    (tmp_path / "pq").mkdir()
    for i, part in enumerate([rows[:60], rows[60:]]):
        pq.write_table(pa.Table.from_pylist([{"text": r} for r in part]), tmp_path / "pq" / f"{i}.parquet")
    assert path_spec(spec["data_files"]) == {"path": "json", "data_files": [spec["data_files"]]}
    for source in (spec["data_files"], str(tmp_path / "pq")):
        got = windows(PackedTokenStream(path_spec(source), TOKENIZER, SEQ, repeat=False))
        assert got == expected_windows(rows), source
    (tmp_path / "a.txt").write_text("\n\n".join(rows))  # one document: one EOS at its end
    got = windows(PackedTokenStream(path_spec(str(tmp_path / "a.txt")), TOKENIZER, SEQ, repeat=False))
    assert got == expected_windows(["\n\n".join(rows)])
    with pytest.raises(ValueError, match="mixes kinds"):
        (tmp_path / "pq" / "x.txt").write_text("hi")
        path_spec(str(tmp_path / "pq"))


@pytest.fixture(scope="module")
def two_specs(rows, tmp_path_factory) -> list[dict]:
    """Two sources: the first 60 and the last 60 paragraphs (jsonl, parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("mix")
    (root / "a.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows[:60]))
    pq.write_table(pa.Table.from_pylist([{"text": r} for r in rows[60:]]), root / "b.parquet")
    return [
        {"path": "json", "data_files": str(root / "a.jsonl")},
        {"path": "parquet", "data_files": str(root / "b.parquet")},
    ]


def test_mixture_draws_and_windows_and_exact_resume(two_specs, rows):
    """Each window's source is the counter-based draw of the weights (w^(1/T) normalized), each source's windows come
    in that source's own order, and 13 + resume + 19 batches (2 workers) equal 32 uninterrupted batches."""
    import numpy as np

    from kempnerforge.data.stream_mixture import CHUNK, StreamingSource

    sources = [StreamingSource("a", two_specs[0], 3.0), StreamingSource("b", two_specs[1], 1.0)]
    dm = StreamingTokenDataModule(tokenizer=TOKENIZER, seq_len=SEQ, micro_batch_size=4, sources=sources,
                                  temperature=2.0, data_seed=7)  # fmt: skip
    p = np.array([3.0, 1.0]) ** 0.5 / (np.array([3.0, 1.0]) ** 0.5).sum()
    got = [b for b, _ in zip(dm.train_dataloader(), range(10), strict=False)]
    srcs = [int(x) for b in got for x in b["source"]]
    u = np.random.default_rng([7, 0, 0]).random(CHUNK)[:40]
    assert srcs == np.searchsorted(np.cumsum(p), u, side="right").tolist()
    per_source = [expected_windows(rows[:60]), expected_windows(rows[60:])]
    seen = [0, 0]
    for window, src in zip(windows({k: b[k][i] for k in b} for b in got for i in range(4)), srcs, strict=True):
        assert window == per_source[src][seen[src]]  # 40 windows: both sources still in their first pass
        seen[src] += 1
    assert 0 < seen[1] < seen[0] and seen[0] < len(per_source[0])

    def loader():
        dm.num_workers = 2
        return dm.train_dataloader()

    ref, _ = batches(loader(), 32)
    first = loader()
    part, _ = batches(first, 13)
    state = first.state_dict()
    again = loader()
    again.load_state_dict(state)
    rest, _ = batches(again, 19)
    assert part + rest == ref
    # A source not drawn since a resume reports the state it was resumed with, not a fresh one.
    mixed = dm.train_dataloader().dataset
    saved = {"windows": 5, "sources": [{**mixed.streams[0].state_dict(), "windows": 3}, mixed.streams[1].state_dict()]}
    mixed.load_state_dict(saved)
    assert mixed.streams[0].state_dict()["windows"] == 3


def test_check_run_refuses_before_the_rendezvous(spec, tmp_path):
    from types import SimpleNamespace

    from kempnerforge.errors import UserError

    dm = StreamingTokenDataModule(spec["data_files"], TOKENIZER, seq_len=SEQ, val_source=spec, num_workers=2)
    ok = SimpleNamespace(max_steps=10, val_check_interval=5)
    dm.check_run(ok, dp_size=2, global_rank=0)
    with pytest.raises(UserError, match="must be a positive integer") as err:
        dm.check_run(SimpleNamespace(max_steps=-1, val_check_interval=5), 1, 0)
    assert err.value.field == "trainer.max_steps"
    with pytest.raises(UserError, match="must be an integer number of steps") as err:
        dm.check_run(SimpleNamespace(max_steps=10, val_check_interval=1.0), 1, 0)
    assert err.value.field == "trainer.val_check_interval"
    with pytest.raises(UserError, match=r"has 120 rows, fewer than its 150 readers") as err:
        dm.check_run(ok, dp_size=75, global_rank=0)
    assert err.value.field == "data.num_workers"
    dm.check_run(ok, dp_size=75, global_rank=1)  # other ranks read nothing
    dm.text_field = "body"
    with pytest.raises(UserError, match=r"text_field='body' is not a text column of data.source \(its first row has"):
        dm.check_run(ok, dp_size=1, global_rank=0)
    with pytest.raises(UserError, match=r"data.sources\[1\].source: '/no/x.jsonl' does not exist") as err:
        from kempnerforge.data.stream_mixture import StreamingSource

        StreamingTokenDataModule(
            tokenizer=TOKENIZER, sources=[StreamingSource("a", spec), StreamingSource("b", "/no/x.jsonl")]
        )
    assert err.value.field == "data.sources[1].source"
