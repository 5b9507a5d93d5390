"""Local data sources shared by eager preparation and streaming: a checked ``load_dataset`` spec and
the fingerprint of a preparation's inputs.

:func:`~kempnerforge.data.prepare.prepare_data` (eager, memmap shards),
:class:`~kempnerforge.data.hf_dataset.PackedTokenStream` (streaming) and
:class:`~kempnerforge.data.datamodule.TokenDataModule` (reuse of prepared shards) all read these, so they
live apart from each of them. Only local data is accepted: a spec naming a Hub dataset is refused before
anything is fetched.
"""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path
from typing import Any

# Packaged builders of `datasets` that read local files only.
LOCAL_BUILDERS = ("text", "json", "parquet", "csv", "arrow")
_TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template")


def _local_paths(value: Any, field: str) -> list[Path]:
    """Expands a ``data_files`` / ``data_dir`` value (str, list or split dict) into existing local paths.

    Raises:
        ValueError: a pattern matching no local file (a remote URL matches nothing).
    """
    if isinstance(value, dict):
        return [p for v in value.values() for p in _local_paths(v, field)]
    patterns = [value] if isinstance(value, str) else list(value)
    found: list[Path] = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"source.{field} must hold path strings, got {pattern!r}")
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise ValueError(f"source.{field}: {pattern!r} matches no local file (only local data is read)")
        found += [Path(m).resolve() for m in matches]
    return found


def check_dataset_spec(spec: dict[str, Any]) -> list[Path]:
    """Checks a ``datasets.load_dataset`` spec names local data only; returns the local paths it reads.

    ``spec`` holds ``load_dataset`` keyword arguments: ``path`` (one of :data:`LOCAL_BUILDERS` or a local
    dataset folder), ``data_files`` and/or ``data_dir``, optional ``split`` (default ``"train"``) and any other
    builder option (e.g. ``sample_by`` for ``text``). ``streaming`` is set by the caller.

    Raises:
        ValueError: ``spec`` is not a dict, has no ``path``, sets ``streaming``, names a Hub dataset, or a
            pattern matches no local file.
    """
    if not isinstance(spec, dict) or "path" not in spec:
        raise ValueError(f"source spec must be a dict of datasets.load_dataset arguments with a 'path', got {spec!r}")
    if "streaming" in spec:
        raise ValueError("source.streaming is set by the data module (streaming or eager), not in the spec")
    path = spec["path"]
    if path not in LOCAL_BUILDERS and not Path(str(path)).expanduser().is_dir():
        raise ValueError(
            f"source.path={path!r} is neither a local builder {LOCAL_BUILDERS} nor a local folder; "
            "Hub datasets are not fetched"
        )
    paths = [] if path in LOCAL_BUILDERS else [Path(path).expanduser().resolve()]
    for field in ("data_files", "data_dir"):
        if spec.get(field) is not None:
            paths += _local_paths(spec[field], field)
    if not paths:
        raise ValueError(f"source.path={path!r} needs data_files or data_dir naming local files")
    return paths


def load_local_dataset(spec: dict[str, Any], streaming: bool = True) -> Any:
    """``datasets.load_dataset(**spec, streaming=streaming)`` after :func:`check_dataset_spec`.

    Returns:
        A ``datasets.IterableDataset`` (streaming) or ``datasets.Dataset`` for ``spec["split"]``
        (default ``"train"``).

    Raises:
        ValueError: see :func:`check_dataset_spec`.
    """
    import datasets

    check_dataset_spec(spec)
    return datasets.load_dataset(**{"split": "train", **spec}, streaming=streaming)


def _file_stamps(paths: list[Path]) -> list[list[Any]]:
    files = sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()})
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def tokenizer_fingerprint(tokenizer: str) -> str:
    """SHA-256 over the tokenizer's own files (``tokenizer*``, ``vocab*``, ``merges*``, ...), not model weights."""
    path = Path(tokenizer).expanduser().resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    digest = hashlib.sha256()
    for f in files:
        if f.name.startswith(_TOKENIZER_FILE_PREFIXES) or f.suffix == ".model" or f == path:
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def source_fingerprint(source: str | dict[str, Any], tokenizer: str, text_field: str) -> str:
    """Hex digest identifying a preparation: the source (spec, file paths, sizes, mtimes), tokenizer and field.

    Like ``make`` and the ``datasets`` cache, a source file is taken as changed when its size or modification
    time changes (hashing a large corpus on every start would cost as much as tokenizing it).
    """
    if isinstance(source, dict):
        described: Any = {"spec": source, "files": _file_stamps(check_dataset_spec(source))}
    else:
        described = {"path": str(Path(source).expanduser().resolve()), "files": _file_stamps([Path(source)])}
    blob = json.dumps([described, tokenizer_fingerprint(tokenizer), text_field], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


#: Builders of ``datasets.load_dataset`` for local files, by suffix (``.txt``: one document per file).
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}


def path_spec(source: str) -> dict[str, Any]:
    """The ``datasets.load_dataset`` spec that streams ``source``: a ``.jsonl``/``.json``/``.parquet``/``.txt``
    file, a folder of one of these kinds (recursive, sorted, hidden files skipped), a glob pattern, or a
    ``datasets.save_to_disk`` folder (its ``.arrow`` files, the ``train`` split of a ``DatasetDict``). A ``.txt``
    file is one document (``sample_by="document"``), as in ``kforge prepare-data``.

    Raises:
        ValueError: nothing matches, no supported file, or several kinds in one source.
    """
    root = Path(source).expanduser()
    if root.is_dir() and (root / "dataset_dict.json").is_file():
        root = root / "train" if (root / "train").is_dir() else next(p for p in sorted(root.iterdir()) if p.is_dir())
    if root.is_dir() and (root / "state.json").is_file():
        files = sorted(root.glob("*.arrow"))
    else:
        matches = [Path(m) for m in sorted(glob.glob(str(root), recursive=True))]
        if not matches:
            raise ValueError(f"{source!r} does not exist (a local file, folder or glob pattern)")
        files = [f for m in matches for f in ([m] if m.is_file() else sorted(m.rglob("*"))) if f.is_file()]
        files = [f for f in files if f.suffix in _BUILDERS and not f.name.startswith(".")]
    if not files:
        raise ValueError(f"{source!r} holds no .jsonl/.json/.parquet/.txt file or save_to_disk folder")
    builders = sorted({_BUILDERS[f.suffix] for f in files})
    if len(builders) > 1:
        raise ValueError(f"{source!r} mixes kinds {builders}; give one kind per source")
    spec: dict[str, Any] = {"path": builders[0], "data_files": [str(f.resolve()) for f in files]}
    if builders[0] == "text":
        spec["sample_by"] = "document"
    return spec
