"""Tokenize local text into memory-mapped token shards (``kforge prepare-data``), on many processes and array parts.

Layout follows nanoGPT's ``prepare.py`` / Megatron-LM's indexed datasets: each document's token ids followed by one
EOS id, in ``shard_NNNNN.npy`` files (``np.save`` format, so ``np.load(mmap_mode="r")`` maps them without reading),
and a ``metadata.json`` that :class:`~kempnerforge.data.memmap.MemmapTokenDataset` reads. Each shard holds a fixed
range of the source (:mod:`~kempnerforge.data.prepare_layout`), so workers and SLURM array parts write the same
shards in any number and order (:mod:`~kempnerforge.data.prepare_run`, :mod:`~kempnerforge.data.prepare_merge`).

Nothing is downloaded: the source is a local file or folder and the tokenizer a local directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from kempnerforge.data.local_tokenizer import LocalTokenizer, load_tokenizer  # noqa: F401  (re-exported)
from kempnerforge.data.shard_files import (  # noqa: F401  (re-exported: the data modules import them from here)
    METADATA_FILE,
    SHARD_PATTERN,
    is_prepare_artifact,
)
from kempnerforge.data.sources import source_fingerprint

#: Source bytes per text shard: 256 MiB of English text is about 64 Mi GPT-2 tokens (128 MiB of uint16).
DEFAULT_SHARD_BYTES = 2**28
#: Tokens per chat shard (chat shards hold whole conversations: ``--format chat``).
DEFAULT_CHAT_SHARD_SIZE = 2**27


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def prepare_data(
    source: str | dict[str, Any],
    tokenizer: str,
    output_dir: str,
    text_field: str = "text",
    shard_size: int | None = None,
    batch_size: int = 1024,
    text_chunk_chars: int = 1 << 20,
    overwrite: bool = False,
    progress: bool = True,
    format: Literal["text", "chat"] = "text",
    messages_field: str = "messages",
    num_proc: int = 1,
    num_workers: int | None = None,
    num_shards: int = 1,
    shard_index: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict[str, Any]:
    """Tokenizes local text into ``shard_NNNNN.npy`` token shards plus ``metadata.json``, on ``num_workers`` processes.

    nanoGPT / Megatron-style memmap token shards: every document becomes its token ids followed by one EOS id,
    in source order. Shard ``u`` holds the documents of about ``shard_bytes`` bytes of the source: the range
    ``[u * shard_bytes, (u + 1) * shard_bytes)`` of the files laid end to end, each end moved forward to the next
    document (row, line) or, inside a ``.txt`` file, to the next line end or whitespace where its tokenization does
    not change (:mod:`~kempnerforge.data.prepare_layout`). The layout depends on the input alone, so any
    ``num_workers``, ``num_shards`` and order of completion write the same files, token for token. Ids are stored
    as uint16 when ``vocab_size <= 65536``, else uint32.

    Each shard is written to a ``.tmp`` name, renamed when complete and then recorded in ``output_dir/.prepare``;
    ``metadata.json`` comes last, so a folder holding it is complete. A killed run (or worker) is resumed by the same
    command: finished shards are kept, the others written again; a partial file is never used.

    Args:
        source: a ``.txt`` file (one document), a folder of ``.txt`` files (one document each, sorted by path), a
            ``.json``/``.jsonl``/``.parquet`` file or a folder of them (one document per row), a
            ``datasets.save_to_disk`` folder, or a dict of local ``datasets.load_dataset`` arguments (``{"path":
            "parquet", "data_files": "x/*.parquet"}``; one document per row; read streaming, one shard of the
            dataset at a time, so no Arrow copy lands in the HF cache).
        tokenizer: local tokenizer directory (``tokenizer.json``, else anything ``transformers.AutoTokenizer``
            loads offline). Never fetched from the Hub.
        output_dir: folder for the shards and ``metadata.json``; created if missing.
        text_field: column holding the text, for json/parquet/save_to_disk sources.
        shard_size: with ``format=chat``, tokens per shard (default 2**27); text shards are cut by ``shard_bytes``.
        batch_size: documents (or text pieces) per ``encode_batch`` call.
        text_chunk_chars: large ``.txt`` files are read and tokenized in pieces of about this many characters, cut
            just before a paragraph break; EOS only at the end of the file. Exact for byte-level BPE (GPT-2, Llama-3
            style); a tokenizer that prepends a space marker to each input (SentencePiece ``Metaspace``) differs at
            the cuts (and at a shard boundary inside a ``.txt`` file).
        overwrite: replace a previous preparation of other inputs in ``output_dir`` instead of refusing (one of the
            same inputs is continued, never replaced).
        progress: show a tqdm progress bar over the source bytes.
        format: ``text`` (documents, above) or ``chat``: jsonl conversations rendered with the tokenizer's chat
            template into token + assistant-mask shards (:func:`~kempnerforge.data.chat_prepare.prepare_chat_data`,
            which documents what it returns; ``text_field``, ``text_chunk_chars``, ``shard_bytes`` and array parts
            do not apply).
        messages_field: with ``format=chat``, the key of each record's message list.
        num_proc: with ``format=chat``, processes rendering the conversations (``num_workers`` sets it too).
        num_workers: processes tokenizing shards (one thread each); default: the CPUs this process may use
            (``os.sched_getaffinity``, e.g. SLURM's ``--cpus-per-task``). A source of one shard is tokenized by one
            process, with the tokenizer's own threads when ``num_workers > 1``.
        num_shards: number of array parts the preparation is split into (e.g. the tasks of a SLURM array); each
            part tokenizes a contiguous block of the shards. Parts may share ``output_dir`` (the last one to finish
            writes ``metadata.json``) or write folders of their own, joined by ``kforge prepare-data --merge``.
        shard_index: this part, in ``[0, num_shards)`` (SLURM: ``$SLURM_ARRAY_TASK_ID``).
        shard_bytes: source bytes per shard (the unit of parallel work: a source of ``B`` bytes gives
            ``ceil(B / shard_bytes)`` shards); default 256 MiB.

    Returns:
        The metadata written to ``metadata.json`` (:func:`~kempnerforge.data.prepare_merge.merge_records`:
        ``tokenizer``, ``vocab_size``, ``dtype``, ``num_tokens``, ``eos_id``, ``shards``, ``source``,
        ``text_field``, ``num_documents``, ``num_empty_documents``, ``max_token_id``,
        ``num_records_without_text_field``, ``fingerprint``, ``shard_bytes``); for an array part while others are
        unfinished, ``{"part", "num_parts", "shards", "num_tokens", "finished", "num_shards_total"}`` instead.

    Raises:
        FileNotFoundError: ``source`` or ``tokenizer`` does not exist.
        FileExistsError: ``output_dir`` holds other files or another preparation and ``overwrite`` is False.
        KeyError: ``text_field`` is not a column of the dataset (lists the columns).
        ValueError: unsupported source, tokenizer without EOS, a bad number, a malformed record.
        RuntimeError: a worker process died; run the same command again.
    """
    if format == "chat":
        return _prepare_chat(source, tokenizer, output_dir, messages_field, shard_size, batch_size, overwrite,
                             progress, num_workers or num_proc, num_shards)  # fmt: skip
    _check_text_args(
        shard_size, num_proc, batch_size, text_chunk_chars, shard_bytes, num_shards, shard_index, num_workers
    )
    from kempnerforge.data.prepare_layout import Layout, source_items
    from kempnerforge.data.prepare_merge import finished, merge_records, open_output, part_shards, plan_record
    from kempnerforge.data.prepare_run import Job, run_shards

    tok = load_tokenizer(tokenizer)
    fingerprint = source_fingerprint(source, tokenizer, text_field)
    layout = Layout(source_items(source), shard_bytes)
    plan = plan_record(
        source, tok, text_field, shard_bytes, text_chunk_chars, fingerprint, layout.num_shards, layout.total
    )
    _check_columns(layout, source, text_field)  # before output_dir is touched
    out = Path(output_dir).expanduser().resolve()
    created = not out.exists()
    open_output(out, plan, overwrite, removes=num_shards == 1)
    job = Job(
        layout, source, tokenizer, text_field, text_chunk_chars, batch_size, str(out), plan["plan"], plan["dtype"]
    )
    mine = part_shards(layout.num_shards, num_shards, shard_index)
    workers = num_workers if num_workers is not None else len(os.sched_getaffinity(0))
    try:
        records = run_shards(job, mine, workers, tok, progress)
        if num_shards == 1:
            return merge_records(out, plan, records)
    except (KeyError, TypeError, ValueError):
        if created and num_shards == 1:  # a refused source leaves no half-written folder behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    done = finished(out, plan)  # every part writing here: the last one to finish merges
    if all(r is not None for r in done):
        return merge_records(out, plan, done)
    return {
        "part": shard_index, "num_parts": num_shards, "shards": [r for r in records if r["file"]],
        "num_tokens": sum(r["num_tokens"] for r in records), "finished": sum(r is not None for r in done),
        "num_shards_total": layout.num_shards,
    }  # fmt: skip


def _check_text_args(
    shard_size: int | None, num_proc: int, batch_size: int, chunk_chars: int, shard_bytes: int, num_shards: int,
    shard_index: int, num_workers: int | None,
) -> None:  # fmt: skip
    """The text preparation's numbers, before anything is read.

    Raises:
        ValueError: each names its argument (``shard_size: ...``) and what is allowed.
    """
    if shard_size is not None:
        raise ValueError(
            "shard_size applies to --format chat; a text shard holds --shard_bytes bytes of the source (so that "
            "workers and array parts write the same shards)"
        )
    if num_proc != 1:
        raise ValueError(f"num_proc={num_proc} applies to --format chat; text uses --num_workers")
    for name, value in (("batch_size", batch_size), ("text_chunk_chars", chunk_chars), ("shard_bytes", shard_bytes),
                        ("num_shards", num_shards), ("num_workers", 1 if num_workers is None else num_workers)):  # fmt: skip
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, num_shards={num_shards}), got {shard_index}")


def _check_columns(layout: Any, source: Any, text_field: str) -> None:
    """``text_field`` is a column of the first table (a parquet schema, a ``datasets`` table, the first jsonl records),
    before anything is written.

    Raises:
        KeyError: it is not (lists the columns that exist).
    """
    from kempnerforge.data import prepare_layout as pl

    first = next((it for it in layout.items if it.size), None)
    if first is None:
        return
    kind = pl.json_kind(first.path) if first.kind == pl.JSON else first.kind
    where, columns = first.path, None
    if kind == pl.JSONL:
        _check_jsonl_keys(Path(first.path), text_field)
    elif kind == pl.PARQUET:
        import pyarrow.parquet as pq

        columns = pq.ParquetFile(first.path).schema_arrow.names
    elif kind == pl.ROWS:
        columns = pl.load_disk_table(first.path).column_names
    elif kind == pl.WHOLE and not first.path:  # a spec (None: a stream whose schema is known once read)
        where, columns = repr(source), pl.load_spec_dataset(source).column_names
    if columns is not None and text_field not in columns:
        raise KeyError(f"text_field={text_field!r} is not a column of {where!r}; columns: {sorted(columns)}")


def _check_jsonl_keys(path: Path, text_field: str, lines: int = 1000) -> None:
    """Raises KeyError when none of the first ``lines`` records of ``path`` has ``text_field`` (a whole file without
    it is a wrong ``--text_field``, not a few records to skip)."""
    keys: set[str] = set()
    with open(path, "rb") as f:
        for _, line in zip(range(lines), f, strict=False):
            try:
                record = json.loads(line)
            except ValueError:
                return  # reported with its line number when the shard is read
            if isinstance(record, dict):
                if text_field in record:
                    return
                keys |= set(record)
    if keys:
        raise KeyError(f"text_field={text_field!r} is not a column of {str(path)!r}; columns: {sorted(keys)}")


def _prepare_chat(source, tokenizer, output_dir, messages_field, shard_size, batch_size, overwrite, progress,
                  num_proc, num_shards) -> dict[str, Any]:  # fmt: skip
    from kempnerforge.data.chat_prepare import ChatDataError, prepare_chat_data

    if num_shards != 1:
        raise ChatDataError("num_shards", "array parts apply to text preparation; chat data is prepared in one run")
    size = DEFAULT_CHAT_SHARD_SIZE if shard_size is None else shard_size
    return prepare_chat_data(
        source, tokenizer, output_dir, messages_field, size, batch_size, overwrite, progress, num_proc
    )
