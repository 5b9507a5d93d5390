"""One pipeline stage of the dense decoder as a module: the submodule a ``PipelineStage`` runs.

The stage shares its modules with the rank's pruned model (:func:`kempnerforge.parallel.pipeline.prune_to_stages`),
which stays the module the optimizer, checkpoints and gradient clipping see (full-model FQNs); the
stage only adds the forward of its slice. Each stage is its own FSDP2 root (torchtitan v0.2 shards
every model part separately).
"""

from __future__ import annotations

import torch
from torch import nn

from kempnerforge.model.rope import pack_rope


class DecoderStage(nn.Module):
    """Blocks ``layers`` of one stage, with the embedding on the first stage and norm + head on the last.

    Args:
        model: the rank's pruned :class:`~kempnerforge.model.Transformer` (after TP / FP8 / AC / compile);
            its RoPE buffers are read at every forward (not registered here, so not duplicated).
        layer_ids: block indices of this stage (keys ``str(i)`` of ``model.layers``).
        first: holds ``tok_embeddings`` (input: token ids).
        last: holds ``norm`` and ``output`` (output: logits).

    Shapes: forward(x) with x ``(batch, seq)`` int64 token ids on the first stage, else the hidden
    states ``(batch, seq, dim)``; returns logits ``(batch, seq, vocab_size)`` on the last stage,
    else hidden states ``(batch, seq, dim)``.
    """

    def __init__(self, model: nn.Module, layer_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self._owner = (model,)  # a tuple: not registered as a submodule (no second copy in state dicts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run embedding (first stage), this stage's blocks, then norm + head (last stage)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        model = self._owner[0]
        seq = h.shape[1]
        rope = pack_rope(model.rope_cos[:seq], model.rope_sin[:seq])  # int32 bits: no bf16 cast at the blocks
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.output is None:
            return h
        return self.output(self.norm(h))
