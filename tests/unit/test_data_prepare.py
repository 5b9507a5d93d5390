"""prepare_data: local text / HF datasets -> uint16 token shards equal to the tokenizer's own ids."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kempnerforge.data.prepare import load_tokenizer, prepare_data
from kempnerforge.data.prepare_cli import prepare_main

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "data" / "tokenizers" / "gpt2"
SHAKESPEARE = REPO / "data" / "tinyshakespeare" / "input.txt"
EOS = 50256


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))


@pytest.fixture(scope="module")
def text() -> str:
    return SHAKESPEARE.read_text()[:20_000]


def encode_docs(tok: Tokenizer, docs: list[str]) -> list[int]:
    """Reference: each document's own encoding followed by EOS."""
    out: list[int] = []
    for d in docs:
        out += tok.encode(d, add_special_tokens=False).ids + [EOS]
    return out


def read_tokens(out: Path) -> np.ndarray:
    meta = json.loads((out / "metadata.json").read_text())
    return np.concatenate([np.load(out / s["file"], mmap_mode="r") for s in meta["shards"]])


def run(source, out, **kw) -> dict:
    return prepare_data(str(source), str(TOKENIZER), str(out), progress=False, **kw)


def test_txt_file_is_one_document_with_metadata(tmp_path, tok, text):
    src = tmp_path / "a.txt"
    src.write_text(text)
    meta = run(src, tmp_path / "out")
    tokens = read_tokens(tmp_path / "out")
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == encode_docs(tok, [text])
    on_disk = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert on_disk == meta
    assert meta["vocab_size"] == 50257 and meta["eos_id"] == EOS and meta["dtype"] == "uint16"
    assert meta["num_tokens"] == len(tokens) and meta["num_documents"] == 1
    assert meta["tokenizer"] == str(TOKENIZER) and meta["source"] == str(src) and meta["text_field"] == "text"
    # The token-id range is recorded per shard, so training start-up never scans the shards for it.
    assert meta["shards"] == [{"file": "shard_00000.npy", "num_tokens": len(tokens), "max_token_id": int(tokens.max())}]
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_large_txt_tokenized_in_chunks_equals_whole_file(tmp_path, tok, text):
    """Cuts before paragraph breaks do not change byte-level BPE ids; EOS only at the end."""
    src = tmp_path / "big.txt"
    src.write_text(text)
    run(src, tmp_path / "out", text_chunk_chars=1500, batch_size=3)
    tokens = read_tokens(tmp_path / "out").tolist()
    assert tokens == encode_docs(tok, [text])
    assert tokens.count(EOS) == 1


def test_chunk_cut_without_paragraph_breaks(tmp_path, tok):
    text = "one line after another, " * 400 + "\nand a last line"
    src = tmp_path / "flat.txt"
    src.write_text(text)
    run(src, tmp_path / "out", text_chunk_chars=100)
    assert read_tokens(tmp_path / "out").tolist() == encode_docs(tok, [text])


def test_folder_of_txt_sorted_one_document_each(tmp_path, tok):
    docs = {"b.txt": "Second file.", "a.txt": "First file.\n", "sub/c.txt": "Third, nested.", "empty.txt": ""}
    for name, body in docs.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_text(body)
    (tmp_path / "src" / "notes.md").write_text("ignored: not .txt")
    meta = run(tmp_path / "src", tmp_path / "out")
    expected = encode_docs(tok, [docs["a.txt"], docs["b.txt"], docs["sub/c.txt"]])
    assert read_tokens(tmp_path / "out").tolist() == expected
    assert meta["num_documents"] == 3 and meta["num_empty_documents"] == 1


ROWS = [
    {"id": 0, "text": "Hello world"},
    {"id": 1, "text": "To be, or not to be:\n\nthat is the question."},
    {"id": 2, "text": ""},
    {"id": 3, "text": "Now is the winter of our discontent"},
]
ROW_DOCS = [r["text"] for r in ROWS if r["text"]]


def test_jsonl_file(tmp_path, tok):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    meta = run(src, tmp_path / "out")
    assert read_tokens(tmp_path / "out").tolist() == encode_docs(tok, ROW_DOCS)
    assert read_tokens(tmp_path / "out")[:3].tolist() == [15496, 995, EOS]
    assert meta["num_documents"] == 3 and meta["num_empty_documents"] == 1


def test_folder_of_jsonl_and_custom_field(tmp_path, tok):
    (tmp_path / "src").mkdir()
    for i, chunk in enumerate([ROWS[:2], ROWS[2:]]):
        rows = [{"body": r["text"], "id": r["id"]} for r in chunk]
        (tmp_path / "src" / f"part{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(tmp_path / "src", tmp_path / "out", text_field="body")
    assert read_tokens(tmp_path / "out").tolist() == encode_docs(tok, ROW_DOCS)


def test_parquet_file(tmp_path, tok):
    pd = pytest.importorskip("pandas")
    src = tmp_path / "d.parquet"
    pd.DataFrame(ROWS).to_parquet(src)
    run(src, tmp_path / "out")
    assert read_tokens(tmp_path / "out").tolist() == encode_docs(tok, ROW_DOCS)


def test_save_to_disk_folder(tmp_path, tok):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    meta = run(tmp_path / "ds", tmp_path / "out")
    assert read_tokens(tmp_path / "out").tolist() == encode_docs(tok, ROW_DOCS)
    assert meta["num_documents"] == 3


def test_missing_text_field_names_field_and_columns(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(KeyError, match=r"text_field='content'.*columns: \['id', 'text'\]"):
        run(src, tmp_path / "out", text_field="content")
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_shard_splitting(tmp_path, tok, text):
    """Each shard holds about shard_bytes of the file, cut where the tokenization does not change: the shards'
    tokens are the file's, EOS once at the end; every shard but the last ends in the middle of the document."""
    src = tmp_path / "a.txt"
    src.write_text(text)
    meta = run(src, tmp_path / "out", shard_bytes=4000)
    sizes = [s["num_tokens"] for s in meta["shards"]]
    assert len(sizes) == -(-len(text.encode()) // 4000) and sum(sizes) == meta["num_tokens"]
    assert [s["file"] for s in meta["shards"]] == [f"shard_{i:05d}.npy" for i in range(len(sizes))]
    assert read_tokens(tmp_path / "out").tolist() == encode_docs(tok, [text])
    shards = [np.load(tmp_path / "out" / s["file"]) for s in meta["shards"]]
    assert all(EOS not in s for s in shards[:-1]) and shards[-1][-1] == EOS
    assert meta["shard_bytes"] == 4000


def test_refuses_non_empty_output_unless_overwrite(tmp_path, text):
    src = tmp_path / "a.txt"
    src.write_text(text)
    out = tmp_path / "out"
    assert len(run(src, out, shard_bytes=4000)["shards"]) > 2
    with pytest.raises(FileExistsError, match=r"output_dir .* is not empty .*overwrite=True"):
        run(src, out)  # another shard_bytes: another preparation
    (out / "notes.md").write_text("mine")
    meta = run(src, out, overwrite=True)
    assert len(meta["shards"]) == 1
    # Stale shards and records gone, the user's file kept.
    assert sorted(p.name for p in out.iterdir()) == [".prepare", "metadata.json", "notes.md", "shard_00000.npy"]
    assert sorted(p.name for p in (out / ".prepare").iterdir()) == ["plan.json", "shard_00000.json"]
    assert run(src, out) == meta  # the same inputs again: nothing to do, the same metadata


def test_missing_tokenizer_and_source(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"tokenizer: .*nope.* does not exist"):
        prepare_data(str(src), str(tmp_path / "nope"), str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match=r"source: .*missing.txt.* does not exist"):
        run(tmp_path / "missing.txt", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written before inputs are validated


def test_unsupported_and_mixed_sources(tmp_path):
    (tmp_path / "x.csv").write_text("text\nhi\n")
    with pytest.raises(ValueError, match=r"no supported files; expected one .txt/.json/.jsonl/.parquet"):
        run(tmp_path / "x.csv", tmp_path / "out")
    (tmp_path / "mix").mkdir()
    (tmp_path / "mix" / "a.txt").write_text("hi")
    (tmp_path / "mix" / "b.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt' is not UTF-8 text"):
        run(tmp_path / "latin1.txt", tmp_path / "out")
    with pytest.raises(ValueError, match=r"mixes formats \['text', 'json'\]"):
        run(tmp_path / "mix", tmp_path / "out")


def _word_level_tokenizer(path: Path, vocab: dict[str, int]) -> None:
    from tokenizers import models, pre_tokenizers

    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir()
    t.save(str(path / "tokenizer.json"))


def test_tokenizer_without_eos_is_refused(tmp_path):
    _word_level_tokenizer(tmp_path / "tok", {"[UNK]": 0, "hello": 1})
    with pytest.raises(ValueError, match=r"has no EOS token: '<\|endoftext\|>' is not in its vocabulary"):
        load_tokenizer(tmp_path / "tok")


def test_large_vocab_is_stored_as_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "<|endoftext|>": 70_001}
    _word_level_tokenizer(tmp_path / "tok", vocab)
    (tmp_path / "a.txt").write_text("w1 w69999 w5")
    meta = prepare_data(str(tmp_path / "a.txt"), str(tmp_path / "tok"), str(tmp_path / "out"), progress=False)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    tokens = read_tokens(tmp_path / "out")
    assert tokens.dtype == np.uint32 and tokens.tolist() == [1, 69_999, 5, 70_001]


def test_transformers_fallback_without_tokenizer_json(tmp_path, tok):
    """A directory with only vocab.json/merges.txt goes through AutoTokenizer, same ids."""
    slow = tmp_path / "gpt2_files"
    slow.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, slow / name)
    loaded = load_tokenizer(slow)
    assert (loaded.vocab_size, loaded.eos_id) == (50257, EOS)
    docs = ["Hello world", "x\n\ny  z"]
    assert loaded.encode_batch(docs) == [tok.encode(d, add_special_tokens=False).ids for d in docs]


def test_cli_prepare_main(tmp_path, tok, capsys):
    src = tmp_path / "a.txt"
    src.write_text("Hello world")
    out = tmp_path / "out"
    prepare_main(["--source", str(src), "--tokenizer", str(TOKENIZER), "--output_dir", str(out), "--progress=false"])
    assert read_tokens(out).tolist() == [15496, 995, EOS]
    assert "wrote 3 tokens (1 documents, 1 shards, uint16)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prepare_main(["--help"])
    assert "source bytes per shard" in capsys.readouterr().out  # per-argument docstrings in --help
