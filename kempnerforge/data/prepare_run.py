"""Tokenizing the shards of a preparation, one shard per task, on worker processes, resumable (``kforge prepare-data``).

Shard ``u`` (its source range from :class:`~kempnerforge.data.prepare_layout.Layout`) is tokenized by one process
into ``shard_{u:05d}.npy.tmp``, renamed to ``shard_{u:05d}.npy`` when complete, and only then recorded in
``.prepare/shard_{u:05d}.json`` (token count, largest id, documents). A shard counts as done when its record names
this preparation's plan and its file has the recorded size: a run that was killed (or a worker that died) leaves
at most a ``.tmp`` file or an unrecorded shard, which the rerun writes again, so a partial file is never used.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from kempnerforge.data.prepare_layout import Layout
from kempnerforge.data.prepare_read import ShardPieces
from kempnerforge.data.shard_files import SHARD_PATTERN, atomic_write

#: Folder (inside the output) of the plan and the per-shard records.
RECORDS_DIR = ".prepare"
PLAN_FILE = "plan.json"
#: A batch of pieces is tokenized once it holds ``batch_size`` pieces or this many characters.
_BATCH_CHARS = 16 << 20


@dataclass(frozen=True)
class Job:
    """What each worker needs to tokenize any shard of one preparation.

    Attributes:
        layout: the shards' source ranges.
        source: the ``source`` argument (path string or ``load_dataset`` spec).
        tokenizer: local tokenizer path.
        text_field, chunk_chars, batch_size: reading options (:class:`~kempnerforge.data.prepare_read.ShardPieces`).
        out: the output folder.
        plan: the plan id (:func:`~kempnerforge.data.prepare_merge.plan_record`), recorded with every shard.
        dtype: ``uint16`` or ``uint32``.
    """

    layout: Layout
    source: Any
    tokenizer: str
    text_field: str
    chunk_chars: int
    batch_size: int
    out: str
    plan: str
    dtype: str


def record_path(out: Path, shard: int) -> Path:
    """``out/.prepare/shard_NNNNN.json``: the record of a finished shard."""
    return out / RECORDS_DIR / f"{Path(SHARD_PATTERN.format(shard)).stem}.json"


def npy_header(num_tokens: int, dtype: str) -> bytes:
    """The ``.npy`` (format 1.0) header ``np.save`` writes for a 1-D array of ``num_tokens`` ``dtype`` values
    (128 bytes for any length numpy writes: it pads the shape for growth)."""
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (num_tokens,)}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def done_record(out: Path, shard: int, plan: str, dtype: str) -> dict[str, Any] | None:
    """The record of ``shard`` when it is finished for ``plan`` (its file, if any, has the recorded size), else None."""
    try:
        record = json.loads(record_path(out, shard).read_text())
    except (OSError, ValueError):
        return None
    if record.get("plan") != plan or record.get("shard") != shard:
        return None
    if record["file"] is None:
        return record
    expected = len(npy_header(record["num_tokens"], dtype)) + record["num_tokens"] * np.dtype(dtype).itemsize
    try:
        return record if (out / record["file"]).stat().st_size == expected else None
    except OSError:
        return None


class _NpyStream:
    """Writes a 1-D ``.npy`` array to ``path.tmp`` as tokens arrive (memory stays at one batch), then renames it.

    The file is byte-identical to ``np.save`` of the whole array: the header, written again at the end with the
    real length, has the same size for any length.
    """

    def __init__(self, path: Path, dtype: str) -> None:
        self.path, self.dtype = path, dtype
        self.tmp = path.with_name(path.name + ".tmp")
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()
        self.f.write(npy_header(0, dtype))
        self.count, self.top = 0, -1

    def add(self, ids: np.ndarray) -> None:
        if len(ids):
            self.f.write(ids.tobytes())
            self.count += len(ids)
            self.top = max(self.top, int(ids.max()))

    def close(self) -> bool:
        """Finishes the file: renamed when it holds tokens (True), removed when empty (False)."""
        self.f.seek(0)
        self.f.write(npy_header(self.count, self.dtype))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if self.count:
            os.replace(self.tmp, self.path)
            return True
        self.tmp.unlink()
        return False

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def tokenize_shard(job: Job, shard: int, tok: Any) -> dict[str, Any]:
    """Tokenizes ``shard`` into its ``.npy`` file (when it holds any token) and writes its record; returns the record:
    ``plan``, ``shard``, ``file`` (None when empty), ``num_tokens``, ``max_token_id``, ``num_documents``,
    ``num_empty_documents``, ``num_records_without_text_field``.

    Raises:
        ValueError / KeyError / TypeError: bad source data (see :class:`~kempnerforge.data.prepare_read.ShardPieces`),
            or a token id that does not fit the vocabulary.
    """
    out = Path(job.out)
    name = SHARD_PATTERN.format(shard)
    pieces = ShardPieces(job.layout.segments(shard), job.source, job.text_field, job.chunk_chars, job.batch_size)
    writer = _NpyStream(out / name, job.dtype)
    try:
        stats = encode_pieces(pieces, tok, writer, job.batch_size)
    except BaseException:
        writer.abort()
        raise
    wrote = writer.close()
    record = {
        "plan": job.plan,
        "shard": shard,
        "file": name if wrote else None,
        "num_tokens": writer.count,
        "max_token_id": writer.top,
        **stats,
        "num_records_without_text_field": pieces.missing,
    }
    atomic_write(record_path(out, shard), lambda f: f.write(json.dumps(record).encode()), unique=True)
    return record


def encode_pieces(pieces: Any, tok: Any, writer: _NpyStream, batch_size: int) -> dict[str, int]:
    """Tokenizes ``(text, ends_document)`` pieces in batches, appends EOS at document ends, feeds ``writer``.

    An empty document (no text at all) writes nothing (it would be a lone EOS) and is counted apart.

    Returns:
        ``{"num_documents", "num_empty_documents"}``.

    Raises:
        ValueError: a token id outside ``[0, vocab_size)`` or the storage dtype.
    """
    limit = min(np.iinfo(writer.dtype).max, tok.vocab_size - 1)
    stats = {"num_documents": 0, "num_empty_documents": 0}
    batch: list[tuple[str, bool]] = []
    chars = 0

    def flush() -> None:
        flat: list[int] = []
        for ids, (_, ends_doc) in zip(tok.encode_batch([t for t, _ in batch]), batch, strict=True):
            flat.extend(ids)
            if ends_doc:
                flat.append(tok.eos_id)
        arr = np.asarray(flat, dtype=np.int64)
        if len(arr) and (int(arr.max()) > limit or int(arr.min()) < 0):
            bad = int(arr.max()) if int(arr.max()) > limit else int(arr.min())
            raise ValueError(f"token id {bad} does not fit vocab_size={tok.vocab_size} / {writer.dtype}")
        writer.add(arr.astype(writer.dtype))
        batch.clear()

    doc_has_text = False
    for text, ends_doc in pieces:
        doc_has_text |= bool(text)
        if text or (ends_doc and doc_has_text):  # ("", True) closes a document: EOS only
            batch.append((text, ends_doc))
            chars += len(text)
        if ends_doc:
            stats["num_documents" if doc_has_text else "num_empty_documents"] += 1
            doc_has_text = False
        if len(batch) >= batch_size or chars >= _BATCH_CHARS:
            flush()
            chars = 0
    if batch:
        flush()
    return stats


# --------------------------------------------------------------------------------------------
# Running a part's shards
# --------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(job: Job, tok: Any = None) -> None:
    """A worker's state: the job and the tokenizer (a forked worker shares the parent's, already loaded)."""
    from kempnerforge.data.local_tokenizer import load_tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the processes are the parallelism
    _WORKER.update(job=job, tok=tok if tok is not None else load_tokenizer(job.tokenizer))


def _worker_shard(shard: int) -> dict[str, Any]:
    return tokenize_shard(_WORKER["job"], shard, _WORKER["tok"])


def run_shards(job: Job, shards: list[int], num_workers: int, tok: Any, progress: bool) -> list[dict[str, Any]]:
    """Tokenizes every shard of ``shards`` that is not done yet, on ``min(num_workers, to do)`` processes (in this
    process when that is 1); returns the records of all of ``shards`` in order.

    One worker alone keeps the tokenizer's own threads when ``num_workers > 1`` (a source smaller than two shards);
    ``num_workers=1`` and pool workers tokenize on one thread each.

    Raises:
        RuntimeError: a worker process died (killed, out of memory); the shards finished so far are kept, and the
            same command continues from them.
        ValueError / KeyError / TypeError: bad source data (the worker's error).
    """
    out = Path(job.out)
    records = {u: done_record(out, u, job.plan, job.dtype) for u in shards}
    todo = [u for u in shards if records[u] is None]
    grid, total = job.layout.shard_bytes, job.layout.total
    weight = {u: max(1, min(total, (u + 1) * grid) - u * grid) for u in shards}  # the grid: no file read here
    bar = tqdm(total=sum(weight.values()), unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    bar.update(sum(weight[u] for u in shards if records[u] is not None))
    workers = min(num_workers, len(todo))
    try:
        if workers <= 1:
            with _tokenizer_threads(num_workers > 1):
                for u in todo:
                    records[u] = tokenize_shard(job, u, tok)
                    bar.update(weight[u])
        else:
            for u, record in _pool(job, todo, workers, tok):
                records[u] = record
                bar.update(weight[u])
    finally:
        bar.close()
    return [records[u] for u in shards]


def _pool(job: Job, todo: list[int], workers: int, tok: Any):
    fork = sys.platform == "linux"
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    init = (job, tok if fork else None)  # fork: nothing is pickled, the workers inherit the loaded tokenizer
    with _tokenizer_threads(False), ProcessPoolExecutor(workers, ctx, _init_worker, init) as pool:
        futures = {pool.submit(_worker_shard, u): u for u in todo}
        try:
            for fut in as_completed(futures):
                yield futures[fut], fut.result()
        except BrokenProcessPool as err:
            raise RuntimeError(
                f"a tokenizing worker process died (killed or out of memory) while preparing {job.out}; run the same "
                "command again: it keeps the shards already finished and writes the others"
            ) from err
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


class _tokenizer_threads:
    """Within the block, the tokenizer's own threads are on (``allow``) or off (``TOKENIZERS_PARALLELISM``, read by
    ``tokenizers`` at each batch call and inherited by forked workers)."""

    def __init__(self, allow: bool) -> None:
        self.allow = allow

    def __enter__(self) -> None:
        self.saved = os.environ.get("TOKENIZERS_PARALLELISM")
        if not self.allow:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"

    def __exit__(self, *exc: object) -> None:
        if self.saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self.saved
