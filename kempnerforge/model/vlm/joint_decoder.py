"""``joint_decoder``: visual tokens prepended to the text in one causal decoder (LLaVA, Liu et al., arXiv:2304.08485).

The backbone is the dense :class:`~kempnerforge.model.Transformer` with the same module names
(``tok_embeddings``, ``layers.{i}``, ``norm``, ``output``) and the same init, so a text checkpoint
loads unchanged and a text-only batch gives the text model's logits. Only text positions produce
logits (the loss is on text only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.attention import padding_attention_mask
from kempnerforge.model.decoder_init import init_decoder_
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import model_rope_tables, pack_rope
from kempnerforge.model.tp_plan import TPPlan, VocabParallelEmbedding, dense_decoder_tp_plan
from kempnerforge.model.transformer import Transformer, TransformerBlock
from kempnerforge.model.vlm.base import VLMBackbone, is_new_key, prefix_sequence, register_arch


def load_matching_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (a dense Transformer's FQNs) into the same-named tensors of ``module``.

    Raises:
        KeyError: a text key of ``module`` (any key without a :data:`NEW_KEY_PARTS` fragment) is missing
            from ``state``, or ``state`` holds keys ``module`` does not have (all of them named).
    """
    own = module.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise KeyError(f"text state dict has keys this backbone does not have: {unknown}")
    missing = sorted(k for k in own if k not in state and not is_new_key(k))
    if missing:
        raise KeyError(f"text state dict is missing keys: {missing}")
    module.load_state_dict(state, strict=False)


@register_arch("joint_decoder")
class JointDecoder(VLMBackbone):
    """LLaVA-style backbone: ``[visual tokens; text tokens]`` through the dense decoder.

    Shapes: see :class:`~kempnerforge.model.vlm.base.VLMBackbone`; the self-attention sees
    ``n_visual + n_text`` positions (RoPE positions 0.. over the joint sequence). Padded visual
    positions are hidden as keys; right-padded text needs no mask under causal attention
    (:func:`~kempnerforge.model.attention.padding_attention_mask`).
    """

    # The dense decoder's tying applies unchanged (same module names and types).
    tie_weights = Transformer.tie_weights

    def __init__(self, text: ModelConfig, vlm: VLMConfig) -> None:
        super().__init__(text, vlm)
        self.tok_embeddings = nn.Embedding(text.vocab_size, text.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(text, i) for i in range(text.n_layers)})
        self.norm = RMSNorm(text.dim, eps=text.norm_eps)
        self.output = nn.Linear(text.dim, text.vocab_size, bias=False)
        cos, sin = model_rope_tables(text)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tie_weights()

    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
        """The dense decoder's plan (:func:`~kempnerforge.model.tp_plan.dense_decoder_tp_plan`); with
        ``sequence_parallel`` (arXiv:2205.05198) the residual stream of the joint ``[visual; text]`` sequence is
        sharded along it: the text embedding stays replicated (the visual tokens join it first), the first block's
        input is split (``Replicate -> Shard(1)``: a local chunk, its gradient all-gathered), the final norm's input
        gathered (the head then reads the text positions only), and the head takes a replicated input."""
        plan = dense_decoder_tp_plan(self.config, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        if sequence_parallel:
            plan.root["tok_embeddings"] = VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=Replicate())
            # Block 0 only: on a later pipeline stage the first block already receives this rank's share.
            plan.root["layers.0"] = PrepareModuleInput(
                input_layouts=(Replicate(), None, None),
                desired_input_layouts=(Shard(1), None, None),
                use_local_output=True,
            )
            plan.root["norm"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
            plan.root["output"] = ColwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )
        return plan

    def sequence_length(self, n_visual: int, n_text: int) -> int:
        """``n_visual + n_text``: both share the self-attention."""
        return n_visual + n_text

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """The dense decoder's rules (:meth:`Transformer.init_weights`, same module names and types), or with
        :attr:`init_from` every parameter read from the text model's folder (identical FQNs)."""
        init_decoder_(self, self.config, seed, done=self.load_init_from_())

    def load_text_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a dense Transformer state dict (identical FQNs). Raises ``KeyError`` naming missing/unknown keys."""
        load_matching_state(self, state)

    def forward(
        self,
        input_ids: torch.Tensor,
        visual: torch.Tensor | None,
        text_mask: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **loss: Any,
    ) -> Any:
        """Text logits (batch, n_text, vocab_size), or with ``labels`` the fused loss (:meth:`VLMBackbone.head`);
        raises ValueError when n_visual + n_text > max_seq_len."""
        h, key_mask, seq = self.joint_input(input_ids, visual, text_mask, visual_mask)
        rope = self.joint_rope(h.shape[1])
        # One mask for every layer. Text is right-padded, so with every visual token real the is_causal
        # kernel runs (None); padded video frames before the text need a mask.
        mask = padding_attention_mask(key_mask, right_padded=visual_mask is None)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        n_text = input_ids.shape[1]
        return self.head(h, slice(seq - n_text, seq), labels, **loss)

    def joint_input(
        self,
        input_ids: torch.Tensor,
        visual: torch.Tensor | None,
        text_mask: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The first block's input: ``(h, key_mask, seq)``, h (batch, seq + pad, dim) the embedded
        ``[visual; text]`` sequence, right-padded to a multiple of :attr:`sequence_parallel_degree` (positions
        after the last token, never attended by a real one, dropped at the head), key_mask (batch, seq + pad) bool
        or None (see :func:`~kempnerforge.model.vlm.base.prefix_sequence`), seq the unpadded length.

        Raises:
            ValueError: ``seq`` exceeds ``ModelConfig.max_seq_len``.
        """
        h, key_mask, _ = prefix_sequence(visual, self.tok_embeddings(input_ids), visual_mask, text_mask)
        seq = h.shape[1]
        if seq > self.rope_cos.shape[0]:
            raise ValueError(
                f"joint sequence of {seq} positions (visual + text) exceeds ModelConfig.max_seq_len="
                f"{self.rope_cos.shape[0]}"
            )
        pad = -seq % self.sequence_parallel_degree
        if pad:  # sequence parallelism splits evenly
            h = F.pad(h, (0, 0, 0, pad))
            key_mask = None if key_mask is None else F.pad(key_mask, (0, pad), value=True)
        return h, key_mask, seq

    def joint_rope(self, positions: int) -> torch.Tensor:
        """Packed RoPE angles (:func:`~kempnerforge.model.rope.pack_rope`, int32 bits: no bf16 cast at the blocks)
        for ``positions`` positions; past ``max_seq_len`` (sequence-parallel padding) the last row repeats."""
        cos, sin = self.rope_cos[:positions], self.rope_sin[:positions]
        extra = positions - cos.shape[0]
        if extra > 0:
            cos, sin = (torch.cat([t, t[-1:].expand(extra, -1)]) for t in (cos, sin))
        return pack_rope(cos, sin)
