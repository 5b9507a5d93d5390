"""MemmapTokenDataset: windows against the raw shard tokens, and one test per error message."""

import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from kempnerforge.data.memmap import MemmapTokenDataset, TokenDataError
from kempnerforge.data.prepare import prepare_data

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "data" / "tokenizers" / "gpt2"
SHAKESPEARE = REPO / "data" / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """About 5.7k GPT-2 tokens of Shakespeare in 4 shards of about 1.4k tokens (5,000 source bytes each)."""
    root = tmp_path_factory.mktemp("memmap")
    (root / "a.txt").write_text(SHAKESPEARE.read_text()[:20_000])
    prepare_data(str(root / "a.txt"), str(TOKENIZER), str(root / "out"), shard_bytes=5000, progress=False)
    return root / "out"


def write_folder(
    root: Path, shards: list[np.ndarray], dtype: str = "uint16", vocab_size: int = 100, record: bool = True
) -> Path:
    """A hand-made prepared folder (metadata written as prepare_data does; ``record=False``: as older
    versions did, without each shard's ``max_token_id``)."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, tokens in enumerate(shards):
        name = f"shard_{i:05d}.npy"
        np.save(root / name, np.asarray(tokens, dtype=dtype))
        entries.append({"file": name, "num_tokens": len(tokens)})
        if record:
            entries[-1]["max_token_id"] = int(np.max(tokens)) if len(tokens) else -1
    meta = {"vocab_size": vocab_size, "dtype": dtype, "shards": entries, "num_tokens": sum(map(len, shards))}
    (root / "metadata.json").write_text(json.dumps(meta))
    return root


def edit_metadata(root: Path, **changes) -> None:
    meta = json.loads((root / "metadata.json").read_text())
    meta.update(changes)
    (root / "metadata.json").write_text(json.dumps(meta))


def test_windows_and_labels_match_raw_tokens(prepared):
    seq_len = 64
    meta = json.loads((prepared / "metadata.json").read_text())
    raw = [np.load(prepared / s["file"]).astype(np.int64) for s in meta["shards"]]
    ds = MemmapTokenDataset(prepared, seq_len)
    # Expected windows, shard by shard: never across a shard boundary.
    expected = [r[k * seq_len : k * seq_len + seq_len + 1] for r in raw for k in range((len(r) - 1) // seq_len)]
    assert len(ds) == len(expected) == sum((len(r) - 1) // seq_len for r in raw)
    first_shard = (len(raw[0]) - 1) // seq_len
    for i in (0, 1, first_shard - 1, first_shard, len(ds) - 1):  # the last window of a shard, the first of the next
        item = ds[i]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (seq_len,)
        assert item["input_ids"].tolist() == expected[i][:-1].tolist()
        assert item["labels"].tolist() == expected[i][1:].tolist()
        assert item["labels"][:-1].tolist() == item["input_ids"][1:].tolist()
    assert ds[-1]["input_ids"].tolist() == ds[len(ds) - 1]["input_ids"].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_windows_view_and_pickle(prepared):
    ds = MemmapTokenDataset(prepared, 32)
    view = ds.windows(10, 20)
    assert len(view) == 10
    assert view[0]["input_ids"].tolist() == ds[10]["input_ids"].tolist()
    assert view[-1]["labels"].tolist() == ds[19]["labels"].tolist()
    assert view.windows(2, 4)[0]["input_ids"].tolist() == ds[12]["input_ids"].tolist()
    with pytest.raises(IndexError, match=r"windows\(5, 11\) needs 0 <= start < stop <= 10"):
        view.windows(5, 11)
    blob = pickle.dumps(view)
    assert len(blob) < 10_000  # the mapped shards are not pickled
    assert pickle.loads(blob)[3]["input_ids"].tolist() == ds[13]["input_ids"].tolist()


def test_model_vocab_may_be_padded_above_tokenizer(prepared):
    assert len(MemmapTokenDataset(prepared, 64, vocab_size=50304)) > 0


def test_seq_len_must_be_positive(prepared):
    with pytest.raises(ValueError, match="seq_len must be a positive number of tokens, got 0"):
        MemmapTokenDataset(prepared, 0)


def test_missing_folder_and_metadata(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data_dir .*nowhere.* does not exist"):
        MemmapTokenDataset(tmp_path / "nowhere", 8)
    np.save(tmp_path / "shard_00000.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(FileNotFoundError, match=r"metadata.json' not found: data_dir is not a prepared token folder"):
        MemmapTokenDataset(tmp_path, 8)


def test_no_shards(tmp_path):
    write_folder(tmp_path, [])
    with pytest.raises(TokenDataError, match=r"lists no shards"):
        MemmapTokenDataset(tmp_path, 8)


def test_listed_shard_missing(tmp_path):
    write_folder(tmp_path, [np.arange(50), np.arange(50)])
    (tmp_path / "shard_00001.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard .*shard_00001.npy' is listed in metadata.json but missing"):
        MemmapTokenDataset(tmp_path, 8)


def test_shard_dtype_disagrees_with_metadata(tmp_path):
    write_folder(tmp_path, [np.arange(50)], dtype="uint16")
    edit_metadata(tmp_path, dtype="uint32")
    with pytest.raises(
        TokenDataError, match=r"shard_00000.npy' has dtype uint16 but metadata.json says dtype='uint32'"
    ):
        MemmapTokenDataset(tmp_path, 8)


def test_unsupported_dtype_in_metadata(tmp_path):
    write_folder(tmp_path, [np.arange(50)])
    edit_metadata(tmp_path, dtype="int64")
    with pytest.raises(TokenDataError, match=r"dtype='int64' is not one of \('uint16', 'uint32'\)"):
        MemmapTokenDataset(tmp_path, 8)


def test_token_count_disagrees_with_metadata(tmp_path):
    write_folder(tmp_path, [np.arange(50)])
    edit_metadata(tmp_path, shards=[{"file": "shard_00000.npy", "num_tokens": 60}])
    with pytest.raises(TokenDataError, match=r"holds 50 tokens but metadata.json says 60"):
        MemmapTokenDataset(tmp_path, 8)


def test_tokenizer_vocab_larger_than_model(prepared):
    with pytest.raises(TokenDataError, match=r"vocab_size=50257 .* but the model's vocab_size=50000; .* >= 50257"):
        MemmapTokenDataset(prepared, 64, vocab_size=50000)


def test_token_id_out_of_vocab_from_the_recorded_range(tmp_path):
    write_folder(tmp_path, [np.arange(50), np.array([1, 2, 150] * 20)], vocab_size=100)
    for check in (True, False):  # the recorded maximum is checked either way: it costs no read
        with pytest.raises(TokenDataError, match=r"shard_00001.npy' holds token id 150 >= vocab_size=100"):
            MemmapTokenDataset(tmp_path, 8, check_token_ids=check)


def test_recorded_range_is_trusted_without_reading_the_shard(tmp_path):
    """A record that says the ids fit is believed: the shard's data is not scanned (no full read at start-up)."""
    write_folder(tmp_path, [np.array([1, 2, 150] * 20)], vocab_size=200)
    meta = json.loads((tmp_path / "metadata.json").read_text())
    meta["vocab_size"] = 100
    meta["shards"][0]["max_token_id"] = 99  # wrong on purpose: a scan would find 150
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    assert len(MemmapTokenDataset(tmp_path, 8)) == 7


def test_old_metadata_without_a_record_is_scanned_once_and_says_so(tmp_path):
    write_folder(tmp_path, [np.arange(50), np.array([1, 2, 150] * 20)], vocab_size=100, record=False)
    with (
        pytest.warns(UserWarning, match=r"records no max_token_id for 2 shard\(s\) .* scanning them"),
        pytest.raises(TokenDataError, match=r"shard_00001.npy' holds token id 150 >= vocab_size=100"),
    ):
        MemmapTokenDataset(tmp_path, 8)
    # Ranks other than global rank 0 pass check_token_ids=False (TokenDataModule): no scan, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(MemmapTokenDataset(tmp_path, 8, check_token_ids=False)) == 6 + 7


def test_short_shard_is_skipped_with_a_warning_naming_it(tmp_path):
    """A shard holds a range of the source (prepare-data's layout), so one may hold less than a window: its tokens
    are skipped, as a shard's tail beyond its last window is, with a warning naming it and the count."""
    write_folder(tmp_path, [np.arange(50), np.arange(5), np.arange(50)])
    with pytest.warns(UserWarning, match=r"shard 'shard_00001.npy' .* has 5 tokens, fewer than seq_len \+ 1 = 9"):
        ds = MemmapTokenDataset(tmp_path, 8)
    assert len(ds) == 6 + 6 and ds[6]["input_ids"].tolist() == list(range(8))  # shard 2's first window follows


def test_single_shard_shorter_than_one_window(tmp_path):
    write_folder(tmp_path, [np.arange(8)])
    with pytest.raises(TokenDataError, match=r"shard 'shard_00000.npy' .* has 8 tokens, fewer than one window"):
        MemmapTokenDataset(tmp_path, 8)
    write_folder(tmp_path, [np.arange(8), np.arange(3)])
    with pytest.raises(TokenDataError, match=r"no shard of .* holds one window of seq_len \+ 1 = 9 tokens"):
        MemmapTokenDataset(tmp_path, 8)


def test_short_last_shard_is_skipped_with_warning(tmp_path):
    """The remainder shard of a corpus is dropped, not an error."""
    write_folder(tmp_path, [np.arange(50), np.arange(3)])
    with pytest.warns(UserWarning, match=r"shard 'shard_00001.npy' .* has 3 tokens, fewer than seq_len \+ 1 = 9"):
        ds = MemmapTokenDataset(tmp_path, 8)
    assert len(ds) == 6 and ds[5]["labels"].tolist() == list(range(41, 49))


def test_corrupt_shard_names_file(tmp_path):
    write_folder(tmp_path, [np.arange(50), np.arange(50)])
    path = tmp_path / "shard_00001.npy"
    path.write_bytes(path.read_bytes()[:-20])  # truncated mid-data
    with pytest.raises(TokenDataError, match=r"shard .*shard_00001.npy' is corrupt or truncated: np.load failed"):
        MemmapTokenDataset(tmp_path, 8)
    path.write_bytes(b"not a npy file")
    with pytest.raises(TokenDataError, match=r"shard_00001.npy' is corrupt or truncated"):
        MemmapTokenDataset(tmp_path, 8)
