"""Token data pipeline: local text -> memmap token shards -> LightningDataModule.

- :func:`prepare_data` / ``kforge prepare-data``: tokenize text files or local HF datasets into
  ``shard_NNNNN.npy`` + ``metadata.json``.
- :class:`MemmapTokenDataset`: ``(seq_len + 1)``-token windows over the shards.
- :class:`TokenDataModule`: train/val split, resumable data-parallel sampling.
- :func:`~kempnerforge.data.chat_prepare.prepare_chat_data` (``kforge prepare-data --format chat``) and
  :class:`ChatDataModule`: chat jsonl rendered with the tokenizer's template, loss on assistant tokens only,
  packed or padded rows.
- :class:`StreamingTokenDataModule` / :class:`PackedTokenStream`: a local Hugging Face dataset read with
  ``streaming=True``, tokenized on the fly, packed, sharded over ranks and workers, exactly resumable.

Names are imported on first use, so ``kforge prepare-data`` does not pay for importing Lightning.
"""

from kempnerforge.lazy_exports import lazy_exports

_EXPORTS = {
    "ChatDataModule": "chat_datamodule",
    "ChatDataset": "chat_dataset",
    "prepare_chat_data": "chat_prepare",
    "MemmapTokenDataset": "memmap",
    "TokenDataError": "memmap",
    "read_metadata": "memmap",
    "ResumableDistributedSampler": "datamodule",
    "TokenDataModule": "datamodule",
    "PackedTokenStream": "hf_dataset",
    "load_local_dataset": "sources",
    "StreamingTokenDataModule": "streaming",
    "load_tokenizer": "local_tokenizer",
    "prepare_data": "prepare",
    "prepare_main": "prepare_cli",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
