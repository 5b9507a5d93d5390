"""Issue 30 check 1: ``kforge prepare-data`` on 1, 2 and 4 workers and as 3 array parts merged in a shuffled order
writes byte-identical shards and equal metadata, whose tokens are the GPT-2 tokenizer's own ids of each file (+ EOS);
a part whose worker is killed (SIGKILL) mid-way fails, and its rerun completes it with the same bytes.

Tiny-shakespeare (1.1 MB, bundled) split into 4 files, 64 KB of source per shard (18 shards, 3 of them holding the
end of one file and the start of the next, and 14 cutting a file inside a document).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kempnerforge.data.prepare import prepare_data
from kempnerforge.data.prepare_layout import Layout, source_items, text_cut
from kempnerforge.data.prepare_merge import merge_prepared

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "data" / "tokenizers" / "gpt2"
SHAKESPEARE = REPO / "data" / "tinyshakespeare" / "input.txt"
EOS = 50256
SHARD_BYTES = 64_000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Tiny-shakespeare in 4 files of unequal sizes, cut at arbitrary bytes (mid-line)."""
    root = tmp_path_factory.mktemp("corpus") / "src"
    root.mkdir()
    data = SHAKESPEARE.read_bytes()
    ends = [0, len(data) // 5 + 17, len(data) // 2 + 3, 3 * len(data) // 4, len(data)]
    for i in range(4):
        (root / f"part{i}.txt").write_bytes(data[ends[i] : ends[i + 1]])
    return root


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> tuple[Path, dict]:
    """One worker, one part: the output the others must equal."""
    out = tmp_path_factory.mktemp("ref") / "w1"
    return out, _prepare(corpus, out, num_workers=1)


def _prepare(corpus: Path, out: Path, **kw) -> dict:
    return prepare_data(str(corpus), str(TOKENIZER), str(out), progress=False, shard_bytes=SHARD_BYTES, **kw)


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*")) if p.is_file()}


def test_reference_is_the_tokenizers_ids_of_each_file(corpus, reference):
    out, meta = reference
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    expected = []
    for f in sorted(corpus.glob("*.txt")):
        expected += tok.encode(f.read_text(), add_special_tokens=False).ids + [EOS]
    tokens = np.concatenate([np.load(out / s["file"]) for s in meta["shards"]])
    assert tokens.dtype == np.uint16 and tokens.tolist() == expected
    layout = Layout(source_items(str(corpus)), SHARD_BYTES)
    assert len(meta["shards"]) == layout.num_shards == 18 and meta["num_documents"] == 4
    assert [s["max_token_id"] for s in meta["shards"]] == [int(np.load(out / s["file"]).max()) for s in meta["shards"]]
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_write_the_same_bytes(corpus, reference, workers, tmp_path):
    ref_out, ref_meta = reference
    meta = _prepare(corpus, tmp_path / "out", num_workers=workers)
    assert meta == ref_meta
    assert _files(tmp_path / "out") == _files(ref_out)  # every shard byte-identical, metadata.json too


def test_array_parts_merged_in_any_order(corpus, reference, tmp_path):
    ref_out, ref_meta = reference
    order = [2, 0, 1]
    for i in order:  # finishing in this order, each in a folder of its own
        part = _prepare(corpus, tmp_path / f"part{i}", num_workers=2 if i == 1 else 1, num_shards=3, shard_index=i)
        assert part["part"] == i and part["finished"] == 6  # 18 shards: 6 each
    random.Random(0).shuffle(order)
    meta = merge_prepared([str(tmp_path / f"part{i}") for i in order], str(tmp_path / "merged"))
    assert meta == ref_meta and _files(tmp_path / "merged") == _files(ref_out)
    assert (
        os.stat(tmp_path / "merged" / "shard_00000.npy").st_ino
        == os.stat(tmp_path / "part0" / "shard_00000.npy").st_ino
    )
    # Parts sharing one folder: the last to finish writes metadata.json itself.
    shared = tmp_path / "shared"
    for i in (1, 2):
        assert "part" in _prepare(corpus, shared, num_workers=1, num_shards=3, shard_index=i)
    assert _prepare(corpus, shared, num_workers=1, num_shards=3, shard_index=0) == ref_meta
    assert _files(shared) == _files(ref_out)


def test_array_parts_started_together_in_one_folder(corpus, reference, tmp_path):
    """3 parts started at once into one empty folder (a SLURM array's first seconds): none refuses the folder the
    others are creating, the last to finish writes metadata.json, and the output equals one run's."""
    ref_out, ref_meta = reference
    out = tmp_path / "shared"
    cmd = [sys.executable, "-m", "kempnerforge.entry", "prepare-data", "--source", str(corpus), "--tokenizer",
           str(TOKENIZER), "--output_dir", str(out), "--shard_bytes", str(SHARD_BYTES), "--num_workers", "1",
           "--num_shards", "3", "--progress", "false", "--shard_index"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*cmd, str(i)], env=env, stderr=subprocess.PIPE, text=True) for i in range(3)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    assert json.loads((out / "metadata.json").read_text()) == ref_meta and _files(out) == _files(ref_out)
    # The moment another part has made .prepare/ but not yet written its plan: taken as an empty folder.
    (tmp_path / "racing" / ".prepare").mkdir(parents=True)
    assert _prepare(corpus, tmp_path / "racing", num_workers=1, num_shards=3, shard_index=0)["part"] == 0


def test_merge_names_missing_shards(corpus, tmp_path):
    _prepare(corpus, tmp_path / "p0", num_workers=1, num_shards=3, shard_index=0)
    with pytest.raises(Exception, match=r"12 of 18 shards are not finished in these folders \(shards 6-17\)"):
        merge_prepared([str(tmp_path / "p0")])


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def test_killed_worker_fails_the_part_and_the_rerun_completes_it(corpus, reference, tmp_path):
    """SIGKILL to one of a part's 2 worker processes once its first shard is recorded: the part exits 1 with one
    line saying to rerun; the rerun keeps the finished shards, writes the rest, and the merge equals the reference."""
    ref_out, ref_meta = reference
    out = tmp_path / "part"
    cmd = [sys.executable, "-m", "kempnerforge.entry", "prepare-data", "--source", str(corpus), "--tokenizer",
           str(TOKENIZER), "--output_dir", str(out), "--shard_bytes", str(SHARD_BYTES // 4), "--num_workers", "2",
           "--num_shards", "2", "--shard_index", "0", "--progress", "false"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((out / ".prepare").glob("shard_*.json")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        workers = _children(proc.pid)
        assert workers, "no worker processes"
        os.kill(workers[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("kforge: error: a tokenizing worker process died"), err[-2000:]
    done = len(list((out / ".prepare").glob("shard_*.json")))
    mine = Layout(source_items(str(corpus)), SHARD_BYTES // 4).num_shards // 2
    assert 0 < done < mine, (done, mine)  # killed mid-way through part 0's shards
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert not list(out.glob("*.tmp"))
    other = subprocess.run(
        [*cmd[:-5], "1", "--progress", "false"], env=env, capture_output=True, text=True, timeout=300
    )
    assert other.returncode == 0 and "wrote" in other.stdout, other.stderr[-2000:]
    meta = json.loads((out / "metadata.json").read_text())
    whole = prepare_data(str(corpus), str(TOKENIZER), str(tmp_path / "whole"), progress=False,
                         shard_bytes=SHARD_BYTES // 4, num_workers=1)  # fmt: skip
    assert meta == whole and _files(out) == _files(tmp_path / "whole")
    tokens = np.concatenate([np.load(out / s["file"]) for s in meta["shards"]])
    ref_tokens = np.concatenate([np.load(ref_out / s["file"]) for s in ref_meta["shards"]])
    assert np.array_equal(tokens, ref_tokens)  # other shard_bytes, the same token stream


def test_text_cut_is_the_first_safe_place_and_never_goes_back(tmp_path):
    """text_cut against a brute-force reading of its rule on random text (multi-byte characters, CR, U+3000, long
    runs), and the pieces it cuts tokenize as the whole does."""
    import re

    import kempnerforge.data.prepare_layout as layout

    rng = random.Random(0)
    alphabet = ["a", "b", " ", "\n", "\t", "é", "€", "\u3000", "😀", "\r", "xyz", "\n\n"]
    limit = 40

    def rule(s: str, offset: int) -> int:
        starts = [len(s[:i].encode()) for i in range(len(s) + 1)]
        ok = [i for i in range(1, len(s)) if starts[i] >= offset and not s[i - 1].isspace()]
        line = next((starts[i] for i in ok if re.match(r"[^\S\n]*\n", s[i:])), None)
        if line is not None and line - offset < limit:
            return line
        return next((starts[i] for i in ok if s[i].isspace()), len(s.encode()))

    path = tmp_path / "t.txt"
    saved = layout.LINE_SEARCH_BYTES, layout._FIRST_BLOCK, layout._BLOCK
    layout.LINE_SEARCH_BYTES, layout._FIRST_BLOCK, layout._BLOCK = limit, 3, 7  # tiny reads: every case of the loop
    try:
        for _ in range(150):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 90)))
            path.write_bytes(s.encode())
            cuts = [text_cut(path, o, len(s.encode())) for o in range(1, len(s.encode()))]
            assert cuts == [rule(s, o) for o in range(1, len(s.encode()))], s
            assert cuts == sorted(cuts)
    finally:
        layout.LINE_SEARCH_BYTES, layout._FIRST_BLOCK, layout._BLOCK = saved
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    text = SHAKESPEARE.read_text()[:30_000]
    path.write_text(text)
    data = text.encode()
    for offset in (1, 777, 5_000, 12_345, 29_000):
        cut = text_cut(path, offset, len(data))
        head, tail = data[:cut].decode(), data[cut:].decode()
        ids = tok.encode(head, add_special_tokens=False).ids + tok.encode(tail, add_special_tokens=False).ids
        assert ids == tok.encode(text, add_special_tokens=False).ids, offset


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """300 paragraphs of Shakespeare as records, a few empty and a few without the text field."""
    paragraphs = SHAKESPEARE.read_text()[:60_000].split("\n\n")[:300]
    out = [{"id": i, "text": p} for i, p in enumerate(paragraphs)]
    out[5]["text"], out[17] = "", {"id": 17}
    return out


def _write_source(kind: str, rows: list[dict], root: Path):
    import datasets

    root.mkdir()
    thirds = [rows[:100], rows[100:200], rows[200:]]
    if kind == "jsonl":
        for i, part in enumerate(thirds):
            (root / f"d{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        return str(root)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        for i, part in enumerate(thirds):
            table = pa.Table.from_pylist([{"id": r["id"], "text": r.get("text")} for r in part])
            pq.write_table(table, root / f"d{i}.parquet", row_group_size=7)
        return str(root)
    if kind == "save_to_disk":
        datasets.Dataset.from_list([{"id": r["id"], "text": r.get("text")} for r in rows]).save_to_disk(str(root))
        return str(root)
    for i, part in enumerate(thirds):  # a load_dataset spec over 3 files: 3 shards of the stream
        (root / f"d{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return {"path": "json", "data_files": str(root / "*.jsonl")}


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "save_to_disk", "spec"])
def test_row_sources_split_at_rows_equal_for_any_workers_and_parts(kind, rows, tmp_path):
    """Each row is a document (empty rows and rows without the field counted, not written); the shards are cut at
    lines, row groups, rows or the spec's files, and 1 worker, 2 workers and 2 merged parts write the same bytes."""
    source = _write_source(kind, rows, tmp_path / "src")
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    expected = [i for r in rows if r.get("text") for i in tok.encode(r["text"], add_special_tokens=False).ids + [EOS]]

    def prep(out: str, **kw) -> dict:
        return prepare_data(source, str(TOKENIZER), str(tmp_path / out), progress=False, shard_bytes=6_000, **kw)

    one = prep("w1", num_workers=1)
    tokens = np.concatenate([np.load(tmp_path / "w1" / s["file"]) for s in one["shards"]])
    assert tokens.tolist() == expected
    assert (one["num_documents"], one["num_empty_documents"], one["num_records_without_text_field"]) == (298, 1, 1)
    assert len(one["shards"]) > 2
    assert prep("w2", num_workers=2) == one and _files(tmp_path / "w2") == _files(tmp_path / "w1")
    for i in (1, 0):
        prep(f"p{i}", num_workers=1, num_shards=2, shard_index=i)
    merged = merge_prepared([str(tmp_path / "p1"), str(tmp_path / "p0")], str(tmp_path / "m"))
    assert merged == one and _files(tmp_path / "m") == _files(tmp_path / "w1")
