"""Eager HF datasets: a load_dataset spec is tokenized once into shards, reused while its inputs are unchanged,
and tokenized again (with a warning) when the source, tokenizer or text field changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import kempnerforge.data.datamodule as datamodule
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.data.memmap import read_metadata
from kempnerforge.data.prepare import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "data" / "tokenizers" / "gpt2"
SHAKESPEARE = REPO / "data" / "tinyshakespeare" / "input.txt"


def paragraphs(start: int, n: int) -> list[str]:
    return [p for p in SHAKESPEARE.read_text()[:40_000].split("\n\n") if p.strip()][start : start + n]


def write_parquet(path: Path, rows: list[str]) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": rows, "upper": [r.upper() for r in rows]}).to_parquet(str(path))


def tokens(data_dir: Path) -> list[int]:
    meta = read_metadata(data_dir)
    return np.concatenate([np.load(data_dir / s["file"]) for s in meta["shards"]]).tolist()


def oracle(rows: list[str], tokenizer: Path = TOKENIZER) -> list[int]:
    tok = load_tokenizer(tokenizer)
    return [i for ids in tok.encode_batch(rows) for i in ids + [tok.eos_id]]


@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    """Counts real tokenizations done by the prepare_data hook."""
    seen: list[tuple] = []
    real = datamodule._prepare_shards

    def counting(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(datamodule, "_prepare_shards", counting)
    return seen


def test_spec_tokenized_once_then_reused_then_redone_on_change(tmp_path, calls):
    src = tmp_path / "train.parquet"
    write_parquet(src, paragraphs(0, 40))
    tok_dir = tmp_path / "gpt2"
    shutil.copytree(TOKENIZER, tok_dir)
    out = tmp_path / "tokens"

    def hook(text_field: str = "text") -> None:
        spec = {"path": "parquet", "data_files": str(tmp_path / "*.parquet")}
        TokenDataModule(str(out), source=spec, tokenizer=str(tok_dir), text_field=text_field).prepare_data()

    hook()
    assert len(calls) == 1 and tokens(out) == oracle(paragraphs(0, 40))
    assert read_metadata(out)["source"]["path"] == "parquet"
    shard_mtime = (out / "shard_00000.npy").stat().st_mtime_ns
    hook()  # same inputs: reused, nothing rewritten
    assert len(calls) == 1 and (out / "shard_00000.npy").stat().st_mtime_ns == shard_mtime

    write_parquet(src, paragraphs(40, 30))  # the source changed
    with pytest.warns(UserWarning, match="prepared from other inputs"):
        hook()
    assert len(calls) == 2 and tokens(out) == oracle(paragraphs(40, 30))

    config = tok_dir / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")  # the tokenizer changed (even trivially)
    with pytest.warns(UserWarning, match="prepared from other inputs"):
        hook()
    assert len(calls) == 3

    with pytest.warns(UserWarning, match="prepared from other inputs"):
        hook(text_field="upper")  # another column
    assert len(calls) == 4 and tokens(out) == oracle([r.upper() for r in paragraphs(40, 30)])
    hook(text_field="upper")
    assert len(calls) == 4


def test_cli_prepared_folder_is_reused_by_the_module(tmp_path, calls):
    """A folder written by prepare_data (kforge prepare-data) with the same inputs is not tokenized again."""
    from kempnerforge.data.prepare import prepare_data

    src = tmp_path / "a.txt"
    src.write_text(SHAKESPEARE.read_text()[:5_000])
    prepare_data(str(src), str(TOKENIZER), str(tmp_path / "tok"), progress=False)
    TokenDataModule(str(tmp_path / "tok"), source=str(src), tokenizer=str(TOKENIZER)).prepare_data()
    assert calls == []


def test_non_local_spec_is_refused_before_anything_is_written(tmp_path):
    dm = TokenDataModule(str(tmp_path / "tok"), source={"path": "org/remote-set"}, tokenizer=str(TOKENIZER))
    with pytest.raises(ValueError, match="neither a local builder"):
        dm.prepare_data()
    assert not (tmp_path / "tok").exists()
