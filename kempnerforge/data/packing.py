"""Document packing: windows of concatenated documents, with per-document attention and boundary labels.

Token shards hold documents back to back, each followed by its EOS token (:func:`prepare_data`), and
a training window cuts ``seq_len + 1`` tokens out of that stream, so one window usually holds the end
of one document and the start of others. With document masking on, a token only attends to earlier
tokens of its own document (:func:`~kempnerforge.model.attention.document_causal_mask`), and the label
at each EOS (which would ask the model to predict the next, unrelated document's first token) is
ignored. This is the "intra-document causal masking" of Llama 3 (arXiv:2407.21783 sec. 3.4) and
torchtitan's document masking.
"""

from __future__ import annotations

import torch

from kempnerforge.training.loss import IGNORE_INDEX


def document_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of every position: the number of EOS tokens strictly before it.

    An EOS belongs to the document it ends. Works on (seq,) or (batch, seq) int64 ids.

    Returns:
        int64 tensor of ``input_ids``' shape, non-decreasing along the last dim, starting at 0.
    """
    is_eos = (input_ids == eos_id).long()
    return is_eos.cumsum(-1) - is_eos


def ignore_boundary_labels(input_ids: torch.Tensor, labels: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``labels`` with :data:`IGNORE_INDEX` wherever the input token is EOS (the next token starts another
    document). Returns a new tensor; shapes (seq,) or (batch, seq)."""
    return labels.masked_fill(input_ids == eos_id, IGNORE_INDEX)


def pack_sample(sample: dict[str, torch.Tensor], eos_id: int) -> dict[str, torch.Tensor]:
    """Add ``doc_ids`` to a ``{"input_ids", "labels"}`` window and ignore its boundary labels."""
    ids = sample["input_ids"]
    return {
        **sample,
        "labels": ignore_boundary_labels(ids, sample["labels"], eos_id),
        "doc_ids": document_ids(ids, eos_id),
    }
