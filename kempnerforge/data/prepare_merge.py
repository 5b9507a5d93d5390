"""The plan of a preparation, its output folder, and the merge of finished shard records into ``metadata.json``.

``.prepare/plan.json`` names the preparation (source, tokenizer, ``text_field``, ``shard_bytes``: the plan id) and
is the same for every worker and array part. ``metadata.json`` is written last, from the shards' records alone
(:func:`merge_records`), so it is the same whatever the number of workers, parts or the order they finished in;
``kforge prepare-data --merge DIR...`` does this for parts written to several folders, linking their shard files
into one folder (hard links, else symbolic links: no token is copied).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from kempnerforge.data.prepare_run import PLAN_FILE, RECORDS_DIR, done_record
from kempnerforge.data.shard_files import METADATA_FILE, atomic_write, is_prepare_artifact, make_writable_dir
from kempnerforge.errors import PathError

#: Bumped when the shard layout changes, so a folder prepared by an older layout is never resumed.
LAYOUT_VERSION = 1


def plan_record(
    source: Any, tok: Any, text_field: str, shard_bytes: int, chunk_chars: int, fingerprint: str, num_shards: int,
    total: int,
) -> dict[str, Any]:  # fmt: skip
    """The plan of one preparation: what determines its shards (``plan``: a digest of the source files' fingerprint,
    the tokenizer, ``text_field``, ``shard_bytes``, ``text_chunk_chars`` and the layout version) and what
    ``metadata.json`` repeats (tokenizer path, ``vocab_size``, ``dtype``, ``eos_id``)."""
    digest = hashlib.sha256(json.dumps([LAYOUT_VERSION, fingerprint, shard_bytes, chunk_chars]).encode()).hexdigest()
    return {
        "plan": digest,
        "num_shards": num_shards,
        "source_bytes": total,
        "shard_bytes": shard_bytes,
        "tokenizer": tok.path,
        "vocab_size": tok.vocab_size,
        "dtype": "uint16" if tok.vocab_size <= 2**16 else "uint32",
        "eos_id": tok.eos_id,
        "source": source if isinstance(source, dict) else str(Path(source).expanduser().resolve()),
        "text_field": text_field,
        "fingerprint": fingerprint,
    }


def read_plan(folder: Path) -> dict[str, Any] | None:
    """``folder/.prepare/plan.json``, or None when there is none (or it does not parse)."""
    try:
        return json.loads((folder / RECORDS_DIR / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return None


def open_output(out: Path, plan: dict[str, Any], overwrite: bool, removes: bool = True) -> None:
    """Makes ``out`` ready for ``plan``'s shards and writes its plan record.

    A folder holding this plan already (an interrupted or finished run, another array part) is kept as it is: its
    finished shards are reused. Any other non-empty folder is refused unless ``overwrite``, which removes the files
    a preparation writes (``metadata.json`` first, so the folder stops looking complete) and nothing else.

    Args:
        removes: False for an array part (``num_shards > 1``): never delete, another part may be writing there.

    Raises:
        FileExistsError: ``out`` cannot be created or written, is not empty (and not this plan's) without
            ``overwrite``, or holds another preparation while ``removes`` is False.
    """
    make_writable_dir(out)
    current = read_plan(out)
    if current is None or current["plan"] != plan["plan"]:
        entries = sorted(p.name for p in out.iterdir())
        if current is None and entries == [RECORDS_DIR]:
            entries = []  # another part of this run is creating it (its plan follows): nothing to replace
        if entries and not (overwrite and removes):
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            advice = (
                "array parts never delete files (another part may be writing): empty it first"
                if overwrite
                else "pass overwrite=True (kforge prepare-data --overwrite true) to replace a previous preparation"
            )
            raise FileExistsError(
                f"output_dir {str(out)!r} is not empty ({len(entries)} entries: {shown}) and holds no part of this "
                f"preparation; {advice}"
            )
        (out / METADATA_FILE).unlink(missing_ok=True)
        for name in entries:
            if name == RECORDS_DIR:
                shutil.rmtree(out / name, ignore_errors=True)
            elif is_prepare_artifact(name):
                (out / name).unlink(missing_ok=True)
    (out / RECORDS_DIR).mkdir(exist_ok=True)
    if current != plan:
        atomic_write(out / RECORDS_DIR / PLAN_FILE, lambda f: f.write(json.dumps(plan, indent=2).encode()), unique=True)


def part_shards(num_shards: int, parts: int, index: int) -> list[int]:
    """Shards of array part ``index`` of ``parts``: the contiguous block ``[index * n // parts, (index + 1) * n // parts)``."""
    return list(range(index * num_shards // parts, (index + 1) * num_shards // parts))


def finished(folder: Path, plan: dict[str, Any]) -> list[dict[str, Any] | None]:
    """The record of every shard of ``plan`` found finished in ``folder`` (None where it is not)."""
    return [done_record(folder, u, plan["plan"], plan["dtype"]) for u in range(plan["num_shards"])]


def merge_records(out: Path, plan: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Writes ``out/metadata.json`` (last) from the shards' records; returns it.

    The metadata :class:`~kempnerforge.data.memmap.MemmapTokenDataset` reads: ``tokenizer``, ``vocab_size``,
    ``dtype``, ``num_tokens``, ``eos_id``, ``shards`` (``[{"file", "num_tokens", "max_token_id"}]``, in source order;
    a shard whose range held no token has no file), ``source``, ``text_field``, ``num_documents``,
    ``num_empty_documents``, ``max_token_id``, ``num_records_without_text_field``, ``fingerprint``, ``shard_bytes``.

    Raises:
        ValueError: no record holds ``text_field`` (``text_field=...``).
        PathError: the source produced no token (field ``source``).
    """
    total = {
        k: sum(r[k] for r in records)
        for k in ("num_documents", "num_empty_documents", "num_records_without_text_field")
    }
    if total["num_records_without_text_field"] and not total["num_documents"]:
        raise ValueError(
            f"text_field={plan['text_field']!r}: none of the {total['num_records_without_text_field']} records of "
            f"{str(plan['source'])!r} holds it; pass --text_field with the key that holds the text"
        )
    shards = [
        {"file": r["file"], "num_tokens": r["num_tokens"], "max_token_id": r["max_token_id"]}
        for r in records
        if r["file"]
    ]
    if not shards:
        raise PathError(
            "source", f"{str(plan['source'])!r} produced no tokens (all {total['num_empty_documents']} documents empty)"
        )
    metadata = {
        "tokenizer": plan["tokenizer"],
        "vocab_size": plan["vocab_size"],
        "dtype": plan["dtype"],
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "eos_id": plan["eos_id"],
        "shards": shards,
        "source": plan["source"],
        "text_field": plan["text_field"],
        "num_documents": total["num_documents"],
        "num_empty_documents": total["num_empty_documents"],
        "max_token_id": max(s["max_token_id"] for s in shards),
        "num_records_without_text_field": total["num_records_without_text_field"],
        "fingerprint": plan["fingerprint"],
        "shard_bytes": plan["shard_bytes"],
    }
    # Parts sharing a folder may finish together: each writes the same bytes under a temporary name of its own.
    atomic_write(out / METADATA_FILE, lambda f: f.write(json.dumps(metadata, indent=2).encode()), unique=True)
    return metadata


def merge_prepared(folders: list[str], output_dir: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Joins the array parts of one preparation, written to ``folders`` (any order), into ``output_dir``.

    Every shard of the plan must be finished in one of the folders. Shard files in another folder than
    ``output_dir`` are hard-linked into it (a symbolic link across filesystems); their records are copied; then
    ``metadata.json`` is written. With one folder and no ``output_dir``, the metadata is written in place.

    Returns:
        The metadata (:func:`merge_records`).

    Raises:
        PathError: a folder without a plan (field ``merge``), folders of different preparations, shards no folder
            has finished (names them and the parts to run again), several folders and no ``output_dir``.
        FileExistsError: ``output_dir`` holds something else (see :func:`open_output`).
    """
    dirs = [Path(f).expanduser().resolve() for f in folders]
    plans = []
    for d in dirs:
        plan = read_plan(d)
        if plan is None:
            raise PathError(
                "merge",
                f"{d} holds no prepare-data part (no {RECORDS_DIR}/{PLAN_FILE}); give the output_dir of each part",
            )
        plans.append(plan)
    if any(p["plan"] != plans[0]["plan"] for p in plans):
        other = next(d for d, p in zip(dirs, plans, strict=True) if p["plan"] != plans[0]["plan"])
        raise PathError(
            "merge",
            f"{other} holds another preparation than {dirs[0]} (source, tokenizer, text_field or shard_bytes differ)",
        )
    plan = plans[0]
    if output_dir is None and len(dirs) > 1:
        raise PathError("output_dir", f"merging {len(dirs)} folders needs --output_dir (the folder to join them in)")
    out = Path(output_dir).expanduser().resolve() if output_dir is not None else dirs[0]
    found: list[tuple[Path, dict[str, Any]] | None] = [None] * plan["num_shards"]
    for d in dirs:
        for u, record in enumerate(finished(d, plan)):
            if found[u] is None and record is not None:
                found[u] = (d, record)
    missing = [u for u, f in enumerate(found) if f is None]
    if missing:
        raise PathError("merge", f"{len(missing)} of {plan['num_shards']} shards are not finished in these folders "
                                 f"(shards {_ranges(missing)}): run the parts that hold them again, then merge")  # fmt: skip
    if out not in dirs:
        open_output(out, plan, overwrite)
    for src_dir, record in found:  # type: ignore[misc]
        if src_dir != out:
            _link_shard(src_dir, out, record)
    return merge_records(out, plan, [r for _, r in found])  # type: ignore[misc]


def _link_shard(src_dir: Path, out: Path, record: dict[str, Any]) -> None:
    """Shard file and record of ``record`` from ``src_dir`` into ``out`` without copying the tokens."""
    from kempnerforge.data.prepare_run import record_path

    if record["file"] is not None:
        src, dst = src_dir / record["file"], out / record["file"]
        tmp = dst.with_name(dst.name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:  # another filesystem (or no hard links there): a symbolic link, relative when possible
            os.symlink(os.path.relpath(src, out), tmp)
        os.replace(tmp, dst)
    atomic_write(record_path(out, record["shard"]), lambda f: f.write(json.dumps(record).encode()), unique=True)


def _ranges(items: list[int]) -> str:
    """``0-3, 7, 9-10`` for ``[0, 1, 2, 3, 7, 9, 10]``."""
    spans, start = [], items[0]
    for prev, cur in zip(items, items[1:] + [None], strict=True):
        if cur != prev + 1 if cur is not None else True:
            spans.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return ", ".join(spans)
