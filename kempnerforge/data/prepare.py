"""Tokenize local text into memory-mapped token shards (``kforge prepare-data``).

Layout follows nanoGPT's ``prepare.py`` / Megatron-LM's indexed datasets, simplified: each
document's token ids followed by one EOS id, concatenated, cut into ``shard_NNNNN.npy`` files
(``np.save`` format, so ``np.load(mmap_mode="r")`` maps them without reading), and a
``metadata.json`` that :class:`~kempnerforge.data.memmap.MemmapTokenDataset` reads.

Nothing is downloaded: the source is a local file or folder and the tokenizer a local directory.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import numpy as np
from tqdm.auto import tqdm

from kempnerforge.data.shard_files import (  # noqa: F401  (re-exported: the data modules import them from here)
    METADATA_FILE,
    SHARD_PATTERN,
    is_prepare_artifact,
)
from kempnerforge.data.shard_files import atomic_write as _atomic_write
from kempnerforge.data.shard_files import prepare_output_dir as _prepare_output_dir
from kempnerforge.data.sources import load_local_dataset, source_fingerprint
from kempnerforge.errors import PathError

_TEXT_SUFFIXES = (".txt",)
_JSON_SUFFIXES = (".json", ".jsonl")
_PARQUET_SUFFIXES = (".parquet",)
_HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
DEFAULT_SHARD_SIZE = 2**27  # 128 Mi tokens = 256 MiB per uint16 shard


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


@dataclass
class LocalTokenizer:
    """A tokenizer loaded from a local directory, reduced to what sharding needs.

    Attributes:
        path: resolved directory (or ``tokenizer.json`` file) it was loaded from.
        vocab_size: number of token ids, including added/special tokens.
        eos_id: id appended after every document.
        encode_batch: ``list[str] -> list[list[int]]`` without special tokens (no BOS/EOS added
            by a post-processor: EOS is appended explicitly, exactly once per document).
    """

    path: str
    vocab_size: int
    eos_id: int
    encode_batch: Callable[[list[str]], list[list[int]]]


def _eos_name_from_config(tok_dir: Path) -> str | None:
    """Reads ``eos_token`` from tokenizer_config.json / special_tokens_map.json (str or dict)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg_path = tok_dir / name
        if not cfg_path.is_file():
            continue
        eos = json.loads(cfg_path.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return None


def load_tokenizer(tokenizer: str | os.PathLike) -> LocalTokenizer:
    """Loads a tokenizer from a local directory, never from the Hugging Face Hub.

    ``dir/tokenizer.json`` is loaded with ``tokenizers.Tokenizer.from_file`` (fast, batched in
    Rust threads); otherwise ``transformers.AutoTokenizer.from_pretrained(dir,
    local_files_only=True)``. A path to a ``tokenizer.json`` file is accepted too. The EOS token
    is the configured ``eos_token``, else ``<|endoftext|>``.

    Raises:
        FileNotFoundError: the path does not exist.
        PathError: a file that is not a ``tokenizer.json``, or a folder without tokenizer files (field ``tokenizer``).
        ValueError: the tokenizer has no EOS token.
    """
    path = Path(tokenizer).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer: {str(tokenizer)!r} does not exist; expected a local tokenizer directory")
    from kempnerforge.data.input_checks import check_tokenizer

    check_tokenizer(tokenizer, "tokenizer")  # a file that is no tokenizer.json, a folder without tokenizer files
    tok_dir = path.parent if path.is_file() else path
    tok_json = path if path.is_file() else path / "tokenizer.json"
    if tok_json.is_file():
        return _from_tokenizers(tok_json, tok_dir)
    return _from_transformers(tok_dir)


def _from_tokenizers(tok_json: Path, tok_dir: Path) -> LocalTokenizer:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_json))
    eos_name = _eos_name_from_config(tok_dir) or "<|endoftext|>"
    eos_id = tok.token_to_id(eos_name)
    if eos_id is None:
        raise ValueError(
            f"tokenizer {str(tok_dir)!r} has no EOS token: {eos_name!r} is not in its vocabulary; "
            "set eos_token in tokenizer_config.json"
        )
    # Added tokens can carry ids past get_vocab_size() in some tokenizer.json files.
    added = tok.get_added_tokens_decoder()
    vocab_size = max([tok.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return LocalTokenizer(str(tok_dir), vocab_size, eos_id, encode_batch)


def _from_transformers(tok_dir: Path) -> LocalTokenizer:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    vocab = tok.get_vocab()
    eos_id = tok.eos_token_id
    if eos_id is None:
        eos_id = vocab.get("<|endoftext|>")
    if eos_id is None:
        raise ValueError(f"tokenizer {str(tok_dir)!r} has no EOS token (no eos_token, no '<|endoftext|>')")
    vocab_size = max(len(tok), max(vocab.values()) + 1)

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=False)["input_ids"]

    return LocalTokenizer(str(tok_dir), vocab_size, int(eos_id), encode_batch)


# --------------------------------------------------------------------------------------------
# Sources: yield (text piece, ends_document) pairs
# --------------------------------------------------------------------------------------------

# A cut just before a whitespace run that follows a non-space character leaves byte-level BPE
# pre-tokenization (GPT-2 / Llama-3 regexes) unchanged: the run's split depends only on what follows
# it, and the token before it ends at the whitespace either way. Prefer paragraph breaks.
_CUT_PATTERNS = (re.compile(r"\S(?=\n[ \t]*\n)"), re.compile(r"\S(?=\n)"), re.compile(r"\S(?=\s)"))


def _cut_point(buf: str) -> int | None:
    """Index at which ``buf`` can be split without changing its tokenization, or None."""
    for pattern in _CUT_PATTERNS:
        last = deque(pattern.finditer(buf), maxlen=1)  # keeps only the last match
        if last:
            return last[0].end()
    return None


def _read(f: Any, n: int, path: Path) -> str:
    try:
        return f.read(n)
    except UnicodeDecodeError as e:
        raise ValueError(f"source file {str(path)!r} is not UTF-8 text ({e})") from e


def iter_text_file(path: Path, chunk_chars: int) -> Iterator[tuple[str, bool]]:
    """Yields one text file (one document) in pieces of about ``chunk_chars`` characters.

    Pieces are cut at paragraph (blank-line) boundaries when possible, so a large file never sits
    in memory whole; only the last piece has ``ends_document=True`` (EOS once per file).
    """
    buf = ""
    # newline="" keeps the bytes as they are (no \r\n -> \n translation).
    with open(path, encoding="utf-8", newline="") as f:
        while block := _read(f, chunk_chars, path):
            buf += block
            cut = _cut_point(buf) if len(buf) >= chunk_chars else None
            if cut:
                yield buf[:cut], False
                buf = buf[cut:]
    yield buf, True  # always, so an empty file still counts as one (empty) document


def _iter_hf_text(dataset: Any, text_field: str, source: str, batch_size: int) -> Iterator[tuple[str, bool]]:
    """Checks ``text_field`` now (before anything is written), then yields each row as a document.

    Raises:
        KeyError: ``text_field`` is not a column (message lists the columns that exist).
        TypeError: a value is not a string (raised while iterating).
    """

    def missing(columns: list[str]) -> KeyError:
        return KeyError(f"text_field={text_field!r} is not a column of {source!r}; columns: {sorted(columns)}")

    columns = dataset.column_names  # None for a stream whose schema is unknown until read
    if columns is not None:
        if text_field not in columns:
            raise missing(columns)
        dataset = dataset.select_columns([text_field])

    return _Rows(dataset, text_field, source, batch_size, missing)


class _Rows:
    """The documents of a ``datasets`` table, one ``(text, True)`` per row; counts the rows that lack
    ``text_field`` (``missing``: a jsonl record without the key reads as None) so they are reported, not
    dropped silently.

    Raises (while iterating):
        KeyError: a batch without the column.
        TypeError: a value is not a string.
        ValueError: a json/jsonl file that does not parse (names the file and its 1-based line).
    """

    def __init__(self, dataset: Any, text_field: str, source: str, batch_size: int, missing: Any) -> None:
        self.dataset, self.text_field, self.source, self.batch_size = dataset, text_field, source, batch_size
        self._missing_error = missing
        self.missing = 0

    def __iter__(self) -> Iterator[tuple[str, bool]]:
        import logging

        # datasets' json reader logs the parse error itself before raising: the one line below says it instead.
        reader_log = logging.getLogger("datasets.packaged_modules.json.json")
        level = reader_log.level
        reader_log.setLevel(logging.CRITICAL)
        try:
            yield from self._rows()
        except Exception as err:
            if type(err).__name__ not in ("ArrowInvalid", "DatasetGenerationError", "JSONDecodeError"):
                raise
            raise ValueError(_bad_json_message(self.source, err)) from err
        finally:
            reader_log.setLevel(level)

    def _rows(self) -> Iterator[tuple[str, bool]]:
        for batch in self.dataset.iter(batch_size=self.batch_size):
            if self.text_field not in batch:
                raise self._missing_error(list(batch))
            for text in batch[self.text_field]:
                if text is None:
                    self.missing += 1
                elif not isinstance(text, str):
                    raise TypeError(
                        f"text_field={self.text_field!r} of {self.source!r} holds {type(text).__name__}, not str"
                    )
                yield text or "", True


def _bad_json_message(source: str, err: BaseException) -> str:
    """``source ...: FILE line N is not JSON (...)``: the first line of the source's json files that does not parse
    (pyarrow's ``row`` counts from 0 within a read block, so it is not a line number)."""
    root = Path(source)
    files = [root] if root.is_file() else _files_with(root, _JSON_SUFFIXES) if root.is_dir() else []
    for path in files:
        if path.suffix != ".jsonl":
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as bad:
                    return f"source {str(path)!r} line {number} is not JSON ({bad.msg}); fix or remove that line"
    return f"source {source!r} does not parse as JSON ({' '.join(str(err).split())[:200]})"


def _files_with(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes and not p.name.startswith("."))


def _load_from_disk(path: Path) -> Any:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            return ds["train"]
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise ValueError(f"source {str(path)!r} holds splits {sorted(ds)}; expected one split or 'train'")
    return ds


def _load_files(builder: str, files: list[Path]) -> Any:
    import datasets

    # Streaming reads the files once, without writing an Arrow copy into the HF cache.
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True)


def iter_source(
    source: str | os.PathLike | dict[str, Any], text_field: str, chunk_chars: int, batch_size: int
) -> tuple[Iterator[tuple[str, bool]], int | None]:
    """Opens ``source`` and returns ``(pieces, num_documents or None)``.

    Accepted: a ``.txt`` file; a ``.json``/``.jsonl``/``.parquet`` file; a ``save_to_disk``
    folder; a folder of ``.txt`` files or of json/jsonl or parquet files (recursive, sorted); a dict of
    ``datasets.load_dataset`` arguments naming local data (one document per row; see
    :func:`~kempnerforge.data.sources.check_dataset_spec`).

    Raises:
        FileNotFoundError: ``source`` does not exist.
        ValueError: unsupported suffix, empty folder, mixed formats in one folder, or a non-local spec.
    """
    if isinstance(source, dict):
        return _iter_hf_text(load_local_dataset(source, streaming=True), text_field, repr(source), batch_size), None
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"source: {str(source)!r} does not exist")
    if path.is_dir() and any((path / m).is_file() for m in _HF_DISK_MARKERS):
        ds = _load_from_disk(path)
        return _iter_hf_text(ds, text_field, str(path), batch_size), len(ds)
    files = [path] if path.is_file() else None
    groups = {
        "text": _TEXT_SUFFIXES,
        "json": _JSON_SUFFIXES,
        "parquet": _PARQUET_SUFFIXES,
    }
    found = {k: ([f for f in files if f.suffix in s] if files else _files_with(path, s)) for k, s in groups.items()}
    kinds = [k for k, v in found.items() if v]
    allowed = "one .txt/.json/.jsonl/.parquet file, a folder of them, or a datasets.save_to_disk folder"
    if not kinds:
        raise ValueError(f"source {str(source)!r}: no supported files; expected {allowed}")
    if len(kinds) > 1:
        raise ValueError(f"source {str(source)!r} mixes formats {kinds}; expected {allowed}")
    kind = kinds[0]
    if kind == "text":
        txts = found["text"]
        return (piece for f in txts for piece in iter_text_file(f, chunk_chars)), len(txts)
    return _iter_hf_text(_load_files(kind, found[kind]), text_field, str(path), batch_size), None


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class ShardWriter:
    """Accumulates token ids and writes full ``shard_size`` shards as they fill.

    Args:
        output_dir: folder receiving ``shard_NNNNN.npy``.
        shard_size: tokens per shard (the last one may be shorter).
        dtype: numpy dtype of the stored ids (uint16 or uint32).
    """

    def __init__(self, output_dir: Path, shard_size: int, dtype: np.dtype) -> None:
        self.output_dir, self.shard_size, self.dtype = output_dir, shard_size, np.dtype(dtype)
        self._buf = np.empty(shard_size, dtype=self.dtype)
        self._fill = 0
        self.shards: list[dict[str, Any]] = []
        self.num_tokens = 0

    def add(self, ids: np.ndarray) -> None:
        """Appends a 1-D array of ids (already checked to fit ``dtype``)."""
        while len(ids):
            take = min(len(ids), self.shard_size - self._fill)
            self._buf[self._fill : self._fill + take] = ids[:take]
            self._fill += take
            ids = ids[take:]
            if self._fill == self.shard_size:
                self._flush()

    @property
    def tokens_written(self) -> int:
        """Tokens added so far, buffered or on disk."""
        return self.num_tokens + self._fill

    def close(self) -> list[dict[str, Any]]:
        """Writes the last partial shard; returns ``[{"file", "num_tokens", "max_token_id"}, ...]``."""
        if self._fill:
            self._flush()
        return self.shards

    def _flush(self) -> None:
        name = SHARD_PATTERN.format(len(self.shards))
        data = self._buf[: self._fill]
        _atomic_write(self.output_dir / name, lambda f: np.save(f, data))
        # The shard's largest id, recorded once here, so a training start checks the vocabulary without
        # reading any shard (MemmapTokenDataset).
        top = int(data.max()) if self._fill else -1
        self.shards.append({"file": name, "num_tokens": int(self._fill), "max_token_id": top})
        self.num_tokens += self._fill
        self._fill = 0


def _encode_pieces(
    pieces: Iterator[tuple[str, bool]],
    tok: LocalTokenizer,
    writer: ShardWriter,
    batch_size: int,
    progress: tqdm,
) -> dict[str, int]:
    """Tokenizes pieces ``batch_size`` at a time, appends EOS at document ends, feeds ``writer``."""
    limit = np.iinfo(writer.dtype).max
    stats = {"num_documents": 0, "num_empty_documents": 0, "max_token_id": -1}
    batch: list[tuple[str, bool]] = []

    def flush() -> None:
        flat: list[int] = []
        for ids, (_, ends_doc) in zip(tok.encode_batch([t for t, _ in batch]), batch, strict=True):
            flat.extend(ids)
            if ends_doc:
                flat.append(tok.eos_id)
        arr = np.asarray(flat, dtype=np.int64)
        if len(arr):
            top = int(arr.max())
            if top > limit or top < 0 or top >= tok.vocab_size:
                raise ValueError(f"token id {top} does not fit vocab_size={tok.vocab_size} / {writer.dtype}")
            stats["max_token_id"] = max(stats["max_token_id"], top)
        writer.add(arr.astype(writer.dtype))
        batch.clear()
        progress.set_postfix_str(f"{writer.tokens_written:,} tokens", refresh=False)

    doc_has_text = False
    for text, ends_doc in pieces:
        doc_has_text |= bool(text)
        if text or (ends_doc and doc_has_text):  # ("", True) closes a document: EOS only
            batch.append((text, ends_doc))
        if ends_doc:
            # An empty document would be a lone EOS between two others: skip it, but count it.
            stats["num_documents" if doc_has_text else "num_empty_documents"] += 1
            doc_has_text = False
            progress.update(1)
        if len(batch) >= batch_size:
            flush()
    if batch:
        flush()
    return stats


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def prepare_data(
    source: str | dict[str, Any],
    tokenizer: str,
    output_dir: str,
    text_field: str = "text",
    shard_size: int = DEFAULT_SHARD_SIZE,
    batch_size: int = 1024,
    text_chunk_chars: int = 1 << 20,
    overwrite: bool = False,
    progress: bool = True,
    format: Literal["text", "chat"] = "text",
    messages_field: str = "messages",
    num_proc: int = 1,
) -> dict[str, Any]:
    """Tokenizes local text into ``shard_NNNNN.npy`` token shards plus ``metadata.json``.

    nanoGPT / Megatron-style memmap token shards: every document becomes its token ids followed
    by one EOS id; documents are concatenated and cut into shards of ``shard_size`` tokens
    (the last shard may be shorter; a document may straddle two shards). Ids are stored as
    uint16 when ``vocab_size <= 65536``, else uint32. Shards are written tmp-then-rename and
    ``metadata.json`` last, so a folder holding ``metadata.json`` is always complete.

    Args:
        source: a ``.txt`` file (one document), a folder of ``.txt`` files (one document each,
            sorted by path), a ``.json``/``.jsonl``/``.parquet`` file or a folder of them (one
            document per row), a ``datasets.save_to_disk`` folder, or a dict of local
            ``datasets.load_dataset`` arguments (``{"path": "parquet", "data_files": "x/*.parquet"}``; one
            document per row; read streaming, so no Arrow copy lands in the HF cache).
        tokenizer: local tokenizer directory (``tokenizer.json``, else anything
            ``transformers.AutoTokenizer`` loads offline). Never fetched from the Hub.
        output_dir: folder for the shards and ``metadata.json``; created if missing.
        text_field: column holding the text, for json/parquet/save_to_disk sources.
        shard_size: tokens per shard (default 2**27 = 256 MiB of uint16).
        batch_size: documents (or text pieces) per ``encode_batch`` call.
        text_chunk_chars: large ``.txt`` files are read and tokenized in pieces of about this
            many characters, cut just before a paragraph break; EOS only at the end of the file.
            Exact for byte-level BPE (GPT-2, Llama-3 style); a tokenizer that prepends a space
            marker to each input (SentencePiece ``Metaspace``) differs at the cuts.
        overwrite: replace an existing preparation in ``output_dir`` instead of refusing.
        progress: show a tqdm progress bar over documents.
        format: ``text`` (documents, above) or ``chat``: jsonl conversations rendered with the tokenizer's chat
            template into token + assistant-mask shards (:func:`~kempnerforge.data.chat_prepare.prepare_chat_data`,
            which documents what it returns; ``text_field`` and ``text_chunk_chars`` do not apply).
        messages_field: with ``format=chat``, the key of each record's message list.
        num_proc: with ``format=chat``, processes rendering the conversations (same output for any value).

    Returns:
        The metadata written to ``metadata.json``: ``tokenizer``, ``vocab_size``, ``dtype``,
        ``num_tokens``, ``eos_id``, ``shards`` (``[{"file", "num_tokens", "max_token_id"}]``), ``source``,
        ``text_field``, ``num_documents``, ``num_empty_documents`` (skipped), ``max_token_id``,
        ``fingerprint`` (:func:`~kempnerforge.data.sources.source_fingerprint` of source, tokenizer and
        ``text_field``, taken before reading; ``TokenDataModule`` reuses the shards while it matches).

    Raises:
        FileNotFoundError: ``source`` or ``tokenizer`` does not exist.
        FileExistsError: ``output_dir`` is not empty and ``overwrite`` is False.
        KeyError: ``text_field`` is not a column of the dataset (lists the columns).
        ValueError: unsupported source, tokenizer without EOS, bad ``shard_size``/``batch_size``.
    """
    if format == "chat":
        from kempnerforge.data.chat_prepare import prepare_chat_data

        return prepare_chat_data(
            source, tokenizer, output_dir, messages_field, shard_size, batch_size, overwrite, progress, num_proc
        )
    if num_proc != 1:
        raise ValueError(f"num_proc={num_proc} applies to format=chat; text is tokenized in batches by one process")
    for name, value in (
        ("shard_size", shard_size),
        ("batch_size", batch_size),
        ("text_chunk_chars", text_chunk_chars),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    tok = load_tokenizer(tokenizer)
    fingerprint = source_fingerprint(source, tokenizer, text_field)
    pieces, num_docs = iter_source(source, text_field, text_chunk_chars, batch_size)
    out = Path(output_dir).expanduser().resolve()
    created = not out.exists()
    _prepare_output_dir(out, overwrite)
    try:
        dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
        writer = ShardWriter(out, shard_size, dtype)
        with tqdm(total=num_docs, unit="doc", desc="tokenizing", disable=not progress) as bar:
            stats = _encode_pieces(pieces, tok, writer, batch_size, bar)
        missing = getattr(pieces, "missing", 0)
        if missing and not stats["num_documents"]:
            raise ValueError(
                f"text_field={text_field!r}: none of the {missing} records of {str(source)!r} holds it; pass "
                "--text_field with the key that holds the text"
            )
        shards = writer.close()
        if not shards:
            raise PathError(
                "source", f"{str(source)!r} produced no tokens (all {stats['num_empty_documents']} documents empty)"
            )
    except BaseException:
        if created:  # a refused source leaves no half-written folder behind
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise
    metadata = {
        "tokenizer": tok.path,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "num_tokens": writer.num_tokens,
        "eos_id": tok.eos_id,
        "shards": shards,
        "source": source if isinstance(source, dict) else str(Path(source).expanduser().resolve()),
        "text_field": text_field,
        **stats,
        "num_records_without_text_field": missing,
        "fingerprint": fingerprint,
    }
    _atomic_write(out / METADATA_FILE, lambda f: f.write(json.dumps(metadata, indent=2).encode()))
    return metadata


def prepare_main(argv: list[str] | None = None) -> None:
    """CLI for ``kforge prepare-data``: every :func:`prepare_data` argument as ``--name``.

    Built with jsonargparse, so ``--help`` shows each argument's docstring and ``--config``
    accepts a YAML file. Prints a one-line summary when done.
    """
    from jsonargparse import ActionConfigFile, ArgumentParser

    from kempnerforge.cli_errors import argparse_error_line
    from kempnerforge.errors import UserError

    class Parser(ArgumentParser):
        def error(self, message: str, ex: Exception | None = None) -> NoReturn:
            if not self.exit_on_error:  # jsonargparse's inner parsers raise instead
                super().error(message, ex)
            line = argparse_error_line(message)  # options are --name here ("format: ..." -> "--format: ...")
            prefix = "kforge: error: "
            if line.startswith(prefix) and not line.startswith(f"{prefix}-") and not line.startswith(f"{prefix}arg"):
                line = f"{prefix}--{line.removeprefix(prefix)}"
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(2)

    parser = Parser(prog="kforge prepare-data", description=prepare_data.__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the arguments below.")
    parser.add_function_arguments(prepare_data, as_group=False)
    cfg = parser.parse_args(argv).as_dict()
    cfg.pop("config", None)
    try:
        from kempnerforge.data.input_checks import check_source, check_tokenizer, check_writable

        if isinstance(cfg.get("source"), str):  # before the tokenizer loads: nothing to read is named first
            check_source(cfg["source"], "source")
        check_tokenizer(cfg["tokenizer"], "tokenizer")
        check_writable(cfg["output_dir"], "output_dir")
        if cfg.get("format") == "chat":  # every record first (one JSON pass): a bad line is one line, no progress bar
            from kempnerforge.data.chat_prepare import check_chat_source

            check_chat_source(cfg["source"], cfg["tokenizer"], cfg["messages_field"])
        meta = prepare_data(**cfg)
    except UserError as err:  # chat data names its argument (source, tokenizer, ...)
        print(f"kforge: error: --{err.field}: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from err
    except (FileNotFoundError, FileExistsError, NotADirectoryError, KeyError, TypeError, ValueError) as err:
        # prepare_data's messages about an argument start with its name: one line naming the option, exit 2.
        message = " ".join(str(err.args[0] if isinstance(err, KeyError) and err.args else err).split())
        arg = re.match(
            r"(source|tokenizer|output_dir|text_field|shard_size|batch_size|text_chunk_chars|num_proc)\b", message
        )
        if arg is None:
            raise
        message = message.removeprefix(f"{arg.group(1)}: ")  # "source: '/x' does not exist": named once
        print(f"kforge: error: --{arg.group(1)}: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from err
    if meta.get("format") == "chat":
        print(
            f"wrote {meta['num_tokens']:,} tokens ({meta['num_conversations']:,} conversations, "
            f"{meta['num_target_tokens']:,} assistant tokens, {len(meta['shards'])} shards, {meta['dtype']}) to "
            f"{Path(cfg['output_dir']).resolve()}"
        )
        return
    print(
        f"wrote {meta['num_tokens']:,} tokens ({meta['num_documents']:,} documents, {len(meta['shards'])} shards, "
        f"{meta['dtype']}) to {Path(cfg['output_dir']).resolve()}"
    )
    if meta.get("num_records_without_text_field"):
        print(
            f"kforge: warning: --text_field: {meta['num_records_without_text_field']:,} records have no "
            f"{meta['text_field']!r} and were skipped",
            file=sys.stderr,
            flush=True,
        )
