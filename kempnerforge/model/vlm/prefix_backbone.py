"""Shared frame of the modality-aware joint-sequence backbones (``mot``, ``moma``).

Both see one sequence ``[visual; text]`` (:func:`~kempnerforge.model.vlm.base.prefix_sequence`) under
one global causal self-attention with RoPE over all positions, keep the text model's token embedding,
final norm and output head (logits for text positions only), and differ only in their blocks. This
module holds that common part: the root modules, the forward skeleton, input checks, the root TP plan
and the per-FQN seeded init loop (as :meth:`kempnerforge.model.Transformer.init_weights`).
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.attention import padding_attention_mask
from kempnerforge.model.decoder_init import init_decoder_
from kempnerforge.model.fused import match_layout
from kempnerforge.model.init import canonical_fqn, copy_full_
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import model_rope_tables, pack_rope
from kempnerforge.model.tp_plan import TPPlan, dense_decoder_tp_plan
from kempnerforge.model.vlm.base import VLMBackbone, prefix_sequence
from kempnerforge.model.vlm.dispatch import ModalityDispatch

# Projections writing into the residual stream (dense FQN suffixes): init std / sqrt(2 * n_layers).


class PrefixBackbone(VLMBackbone):
    """Embedding, ``layers`` of modality-aware blocks, final RMSNorm and output head over ``[visual; text]``.

    Subclasses build ``self.layers`` (blocks called as ``block(h, rope, key_mask, dispatch, attn_mask)``:
    ``key_mask`` (batch, seq) bool or None marks real positions, ``attn_mask`` is the self-attention mask
    for :func:`~kempnerforge.model.attention.attend`, built once per forward; see
    :class:`~kempnerforge.model.vlm.dispatch.ModalityDispatch`), define :meth:`block_tp_plan`,
    and may override :meth:`seed_fqn` (init) and :meth:`text_key` / :meth:`from_text` / :meth:`text_copies` (warm start).

    Shapes: see :class:`~kempnerforge.model.vlm.base.VLMBackbone`; RoPE ``rope_cos`` / ``rope_sin``
    (max_seq_len, head_dim) fp32 are non-persistent buffers recomputed by :meth:`init_weights`.

    Raises:
        ValueError: at construction when ``text.num_experts > 0`` (the token-choice MoE FFN of the
            text model does not combine with per-modality FFNs; ``moma`` has its own experts).
    """

    def __init__(self, text: ModelConfig, vlm: VLMConfig) -> None:
        if text.num_experts > 0:
            raise ValueError(
                f"vlm.arch={vlm.arch!r} needs ModelConfig.num_experts=0 (got {text.num_experts}): its blocks carry "
                "their own per-modality FFNs (moma: expert groups sized by vlm.moma_experts_per_modality)."
            )
        super().__init__(text, vlm)
        self.tok_embeddings = nn.Embedding(text.vocab_size, text.dim)
        self.norm = RMSNorm(text.dim, eps=text.norm_eps)
        self.output = nn.Linear(text.dim, text.vocab_size, bias=False)
        cos, sin = model_rope_tables(text)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tie_weights()

    # -- the contract -----------------------------------------------------------------------------

    def sequence_length(self, n_visual: int, n_text: int) -> int:
        """``n_visual + n_text``: the visual prefix and the text share one self-attention."""
        return n_visual + n_text

    def tie_weights(self) -> None:
        """With ``config.tie_embeddings``, make ``output.weight`` the embedding's Parameter (after ``to_empty``)."""
        if self.config.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        visual: torch.Tensor | None,
        text_mask: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **loss: Any,
    ) -> Any:
        """Text logits (batch, n_text, vocab_size) from ids (batch, n_text) and visual (batch, n_visual, dim), or
        with ``labels`` (batch, n_text) the fused head + loss's ``(loss_sum, z_sum)`` (:meth:`VLMBackbone.head`).

        Raises:
            ValueError: shapes or dtypes of the inputs disagree (named), or ``n_visual + n_text``
                exceeds ``ModelConfig.max_seq_len``.
        """
        self._check_inputs(input_ids, visual, text_mask, visual_mask)
        n_vis = 0 if visual is None else visual.shape[1]
        h, key_mask, _ = prefix_sequence(visual, self.tok_embeddings(input_ids), visual_mask, text_mask)
        dispatch = ModalityDispatch.prefix(n_vis, input_ids.shape[1])  # the layout is known on the host
        # Right-padded text with every visual token real: the is_causal kernel (see padding_attention_mask).
        attn_mask = padding_attention_mask(key_mask, right_padded=visual_mask is None)
        seq = h.shape[1]
        rope = pack_rope(self.rope_cos[:seq], self.rope_sin[:seq])  # int32 bits: no bf16 cast at the blocks
        for layer in self.layers.values():
            h = layer(h, rope, key_mask, dispatch, attn_mask)
        return self.head(h, slice(n_vis, None), labels, **loss)

    def _check_inputs(self, input_ids, visual, text_mask, visual_mask) -> None:
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(
                f"input_ids must be (batch, n_text) integer ids, got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        bsz, n_text = input_ids.shape
        n_vis = 0
        if visual is not None:
            if visual.dim() != 3 or visual.shape[0] != bsz or visual.shape[2] != self.config.dim:
                raise ValueError(
                    f"visual must be (batch={bsz}, n_visual, dim={self.config.dim}), got {tuple(visual.shape)}"
                )
            n_vis = visual.shape[1]
        for name, mask, length in (("text_mask", text_mask, n_text), ("visual_mask", visual_mask, n_vis)):
            if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (bsz, length)):
                raise ValueError(
                    f"{name} must be a ({bsz}, {length}) bool tensor or None, got {mask.dtype} {tuple(mask.shape)}"
                )
        if visual is None and visual_mask is not None:
            raise ValueError("visual_mask given without visual tokens (visual=None).")
        seq = self.sequence_length(n_vis, n_text)
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"n_visual + n_text = {n_vis} + {n_text} = {seq} exceeds "
                f"ModelConfig.max_seq_len={self.config.max_seq_len}"
            )

    # -- tensor parallelism -----------------------------------------------------------------------

    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
        """Root plan of the dense decoder (vocab-parallel embedding, column-parallel head) plus
        :meth:`block_tp_plan`.

        Raises:
            ValueError: ``sequence_parallel=True``: per-modality gathers index the whole sequence,
                which a sequence-sharded residual stream does not hold.
        """
        if sequence_parallel:
            raise ValueError(
                f"sequence_parallel=True is not supported by vlm.arch={self.vlm_config.arch!r}: its per-modality "
                "dispatch gathers tokens across the whole sequence. Use sequence_parallel=False."
            )
        root = dense_decoder_tp_plan(self.config, sequence_parallel=False, loss_parallel=loss_parallel).root
        return TPPlan(root=root, block=self.block_tp_plan())

    @abc.abstractmethod
    def block_tp_plan(self) -> dict[str, ParallelStyle]:
        """FQN (relative to a block) -> style, for the subclass's blocks."""

    # -- init and warm start ----------------------------------------------------------------------

    def seed_fqn(self, fqn: str) -> str:
        """The FQN whose seed initializes parameter ``fqn`` (canonical, no wrapper parts). Identity
        here; MoT maps every modality's copy to the dense text model's FQN."""
        return fqn

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter and the RoPE tables in place; the model's only init.

        Rules of :meth:`kempnerforge.model.Transformer.init_weights`: RMSNorm weights ones; Linear /
        Embedding weights and packed expert weights N(0, init_std**2) truncated at +-3 std, residual
        outputs (``wo``, ``w2``) at init_std / sqrt(2 * n_layers); each drawn from (seed,
        :meth:`seed_fqn`) on CPU, so the result is sharding- and RNG-state-independent.

        With :attr:`init_from`, every parameter with a :meth:`text_key` is read from the text model's folder instead
        (:meth:`load_init_from_`, through :meth:`text_copies` for stacked copies); the rest (MoMa's routers) keeps
        these rules.

        Raises:
            RuntimeError: a parameter no rule covers.
            KeyError, ValueError: see :meth:`load_init_from_`.
        """
        init_decoder_(self, self.config, seed, seed_fqn=self.seed_fqn, done=self.load_init_from_())

    def from_text(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """The value of parameter ``fqn`` made from its dense tensor ``full``. Identity here."""
        return full

    @torch.no_grad()
    def load_text_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Warm start from a dense :class:`~kempnerforge.model.Transformer` state dict (its FQNs),
        through :meth:`text_key` / :meth:`from_text`.

        Works on plain or sharded (FSDP2 / TP DTensor) parameters. A DTensor value that :meth:`from_text`
        leaves on the parameter's mesh and placements (a dense model sharded the same way) is copied shard by
        shard, with no communication and no full tensor; any other DTensor is gathered (``full_tensor``) and a
        plain (full) tensor sliced to this rank's shard. Every key is checked before anything is copied.

        Raises:
            KeyError: keys this backbone needs are missing, or the state dict holds keys it cannot
                place (e.g. an MoE checkpoint), each listed.
            ValueError: a tensor's shape differs from the parameter it fills.
        """
        state = {canonical_fqn(k): v for k, v in state.items()}
        params = list(self.named_parameters(remove_duplicate=False))  # a tied head keeps its own key
        keys = {canonical_fqn(n): self.text_key(canonical_fqn(n)) for n, _ in params}
        # A text model with the other projection layout (fuse_qkv / fuse_w13, or MoT's own separate projections).
        state = match_layout(state, {k for k in keys.values() if k is not None}, self.config)
        missing = sorted({k for k in keys.values() if k is not None and k not in state})
        unexpected = sorted(set(state) - set(keys.values()))
        if missing or unexpected:
            raise KeyError(
                f"{type(self).__name__}.load_text_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
        for name, param in params:
            fqn = canonical_fqn(name)
            if keys[fqn] is not None:
                value = self.from_text(fqn, state[keys[fqn]])
                if _same_layout(value, param):
                    param.to_local().copy_(value.to_local())
                else:
                    copy_full_(param, value.full_tensor() if isinstance(value, DTensor) else value)


def _same_layout(value: torch.Tensor, param: torch.Tensor) -> bool:
    """Both DTensors of one global shape on one mesh with the same placements: the local shards correspond."""
    return (
        isinstance(value, DTensor)
        and isinstance(param, DTensor)
        and value.shape == param.shape
        and value.device_mesh == param.device_mesh
        and tuple(value.placements) == tuple(param.placements)
    )
