"""A tokenizer from a local directory (``tokenizer.json`` or a ``transformers`` folder), reduced to what sharding,
streaming and evaluation need: its vocabulary size, its EOS id and a batched encode. Never from the Hub."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


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

    # encode_batch_fast (tokenizers >= 0.21) skips the character offsets: the same ids, 5-20% less CPU.
    batch = getattr(tok, "encode_batch_fast", tok.encode_batch)

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in batch(texts, add_special_tokens=False)]

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
