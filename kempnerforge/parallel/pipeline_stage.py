"""One pipeline stage of the dense decoder as a module: the submodule a ``PipelineStage`` runs.

The stage shares its modules with the rank's pruned model (:func:`kempnerforge.parallel.pipeline.prune_to_stages`),
which stays the module the optimizer, checkpoints and gradient clipping see (full-model FQNs); the
stage only adds the forward of its slice. Each stage is its own FSDP2 root (torchtitan v0.2 shards
every model part separately).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kempnerforge.model.init import canonical_fqn
from kempnerforge.model.rope import pack_rope
from kempnerforge.parallel.context_parallel import ContextShard
from kempnerforge.parallel.contract import is_moe_layer


class DecoderStage(nn.Module):
    """Blocks ``layers`` of one stage, with the embedding on the first stage and norm + head on the last.

    Args:
        model: the rank's pruned :class:`~kempnerforge.model.Transformer` (after TP / FP8 / AC / compile);
            its RoPE buffers are read at every forward (not registered here, so not duplicated).
        layer_ids: block indices of this stage (keys ``str(i)`` of ``model.layers``).
        first: holds ``tok_embeddings`` (input: token ids).
        last: holds ``norm`` and ``output`` (output: logits); with a tied head also ``tok_embeddings``
            (the head's weight, not looked up here), so FSDP2 shards the shared weight as one unit.

    :attr:`cp` (set by :class:`~kempnerforge.parallel.pipeline_runner.PipelineRunner` before each schedule run
    under context parallelism): this rank's :class:`~kempnerforge.parallel.context_parallel.ContextShard`, the same
    for every micro-batch (no packed documents under pp); RoPE then rotates by global position and attention
    masks by it, as :meth:`Transformer.forward <kempnerforge.model.Transformer.forward>` does with ``cp=``.

    :attr:`after_blocks` (set by :class:`~kempnerforge.parallel.pipeline_runner.PipelineRunner` for MoE
    models) runs on the hidden states after the stage's last block: it puts the stage's MoE auxiliary
    losses into the backward (:mod:`kempnerforge.parallel.pipeline_aux`).

    Shapes: forward(x) with x ``(batch, seq)`` int64 token ids on the first stage (``seq``: this cp rank's
    share with cp), else the hidden states ``(batch, seq, dim)``; returns logits ``(batch, seq, vocab_size)`` on the last stage,
    else hidden states ``(batch, seq, dim)``.
    """

    def __init__(self, model: nn.Module, layer_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first = first
        tied = last and model.tok_embeddings is not None and model.output.weight is model.tok_embeddings.weight
        self.tok_embeddings = model.tok_embeddings if first or tied else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self._owner = (model,)  # a tuple: not registered as a submodule (no second copy in state dicts)
        self.after_blocks: Callable[[DecoderStage, torch.Tensor], torch.Tensor] | None = None
        self.cp: ContextShard | None = None
        #: Sequence-parallel degree (tp with sequence_parallel, else 1): the hidden states are this rank's share of
        #: the sequence, while RoPE covers the whole of it (the attention gathers it).
        self.sp_degree = 1

    def moe_layers(self) -> dict[str, nn.Module]:
        """This stage's MoE layers by canonical FQN (``layers.1.moe``), found through any wrapper."""
        return {canonical_fqn(n): m for n, m in self.named_modules() if is_moe_layer(m)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run embedding (first stage), this stage's blocks, then norm + head (last stage)."""
        h = self.tok_embeddings(x) if self.first else x
        model = self._owner[0]
        mask = None
        if self.cp is None:
            seq = h.shape[1] * self.sp_degree  # with SP the embedding already returns this rank's share
            rope = pack_rope(model.rope_cos[:seq], model.rope_sin[:seq])  # int32 bits: no bf16 cast at the blocks
        else:  # one mask for every block, in the compute dtype (see ContextShard.attention_mask)
            rope = pack_rope(model.rope_cos[self.cp.positions], model.rope_sin[self.cp.positions])
            mask = self.cp.attention_mask(dtype=h.dtype)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.after_blocks is not None:
            h = self.after_blocks(self, h)
        if self.output is None:
            return h
        return self.output(self.norm(h))


class JointDecoderStage(DecoderStage):
    """One pipeline stage of a ``joint_decoder`` vision-language model (LLaVA layout,
    :class:`~kempnerforge.model.vlm.joint_decoder.JointDecoder`): the first stage also holds the vision encoder and
    the connector and builds the ``[visual; text]`` sequence, the last applies the final norm and the head to the
    text positions only.

    Args:
        model: the rank's pruned :class:`~kempnerforge.model.vlm.model.VisionLanguageModel` (``encoder`` /
            ``connector`` None unless this rank holds stage 0).
        layer_ids, first, last: as :class:`DecoderStage` (over ``model.backbone``).

    :attr:`text` (set by :class:`~kempnerforge.parallel.pipeline_runner.PipelineRunner` before each schedule run,
    from the batch's shapes): the text positions ``slice(n_visual, n_visual + n_text)`` of the joint sequence.

    Every visual token must be real (images, or clips with no padded frame), so every stage runs the ``is_causal``
    kernel with no mask: the single-tensor stage boundary carries no per-sequence mask (video with padded frames
    is refused under pp by :func:`~kempnerforge.parallel.pipeline.validate_pipeline_run`).

    Shapes: forward(x, pixel_values) with x ``(batch, n_text)`` int64 and pixel_values ``(batch, 3, H, W)`` or
    ``(batch, frames, 3, H, W)`` on the first stage, else x the hidden states ``(batch, seq, dim)`` (``seq`` =
    ``n_visual + n_text``, padded to a multiple of the sequence-parallel degree and divided by it under SP after the
    first block); returns logits ``(batch, n_text, vocab_size)`` on the last stage, else hidden states.
    """

    def __init__(self, model: nn.Module, layer_ids: range, first: bool, last: bool) -> None:
        super().__init__(model.backbone, layer_ids, first, last)
        self.encoder = model.encoder if first else None
        self.connector = model.connector if first else None
        self._vlm = (model,)  # not a submodule (its parts are registered above)
        self.text: slice | None = None

    def fsdp_units(self) -> list[nn.Module]:
        """The first stage's vision units (encoder layers, encoder, connector: as the unsplit VLM's), else none."""
        return [*self.encoder.layers, self.encoder, self.connector] if self.first else []

    def forward(self, x: torch.Tensor, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder + connector + embedding (first stage), this stage's blocks, norm + head on the text (last)."""
        backbone = self._owner[0]
        if self.first:
            h, _, _ = backbone.joint_input(x, self._vlm[0].visual_tokens(pixel_values))
            positions = h.shape[1]  # replicated until the first block splits it (SP)
        else:
            h, positions = x, x.shape[1] * self.sp_degree
        rope = backbone.joint_rope(positions)
        for layer in self.layers.values():
            h = layer(h, rope, None)
        if self.after_blocks is not None:
            h = self.after_blocks(self, h)
        if self.output is None:
            return h
        return backbone.head(h, self.text)
