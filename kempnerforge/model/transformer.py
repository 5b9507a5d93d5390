"""Llama-3 style dense decoder (Grattafiori et al., arXiv:2407.21783).

Module names follow torchtitan (``tok_embeddings``, ``layers.{i}.attention.wq``, ``feed_forward.w1``,
``norm``, ``output``): they are the contract for the tensor-parallel plan, FSDP2 wrapping, DCP
checkpoint FQNs and the HF key mapping (``kempnerforge.checkpoint.hf_llama``).
"""

from __future__ import annotations

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.attention import Attention, document_attention_mask
from kempnerforge.model.decoder_init import init_decoder_
from kempnerforge.model.init import canonical_fqn
from kempnerforge.model.mla import MultiHeadLatentAttention
from kempnerforge.model.mlp import FeedForward
from kempnerforge.model.moe import MoE
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import model_rope_tables, pack_rope, unpack_rope
from kempnerforge.model.tp_plan import TPPlan, dense_decoder_tp_plan
from kempnerforge.parallel.context_parallel import ContextShard
from kempnerforge.training.loss_impl import fused_head_loss


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x)); out = h + ffn(ffn_norm(h))``.

    ``ffn`` is the dense SwiGLU ``feed_forward`` or, for MoE layers (``config.is_moe_layer(layer)``),
    the :class:`~kempnerforge.model.moe.MoE` module ``moe``; the two names never coexist, so FQNs of
    a dense model are unchanged by the MoE fields.

    Shapes: forward(x (batch, seq, dim), rope (2, seq, rope_head_dim) int32, key_mask (batch, seq) bool or None)
    -> (batch, seq, dim); ``rope`` is the fp32 RoPE tables' bits (:func:`~kempnerforge.model.rope.pack_rope`:
    a block is an FSDP2 unit, whose mixed-precision policy would cast fp32 tables to bf16); see
    :meth:`Attention.forward` for ``key_mask``.
    """

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = MultiHeadLatentAttention(config) if config.attention == "mla" else Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        if config.is_moe_layer(layer):
            self.moe = MoE(config)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_hidden, fused=config.fuse_w13)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the block to ``x`` (batch, seq, dim)."""
        cos, sin = unpack_rope(rope)
        # key_mask by keyword: TP's PrepareModuleInput (sequence parallel) lays out the positional inputs only.
        h = x + self.attention(self.attention_norm(x), cos, sin, key_mask=key_mask)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int, attn_mask: torch.Tensor
    ) -> torch.Tensor:
        """The block for incremental decoding (see :meth:`Attention.forward_cached`); x (batch, new, dim)."""
        h = x + self.attention.forward_cached(self.attention_norm(x), cos, sin, cache, layer, attn_mask)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only language model: embedding, ``n_layers`` blocks, final RMSNorm, output head.

    Build it on the meta device, shard it, ``to_empty``, then call :meth:`tie_weights` and
    :meth:`init_weights`: the constructor does not produce meaningful weights. RoPE ``rope_cos`` /
    ``rope_sin`` (max_seq_len, head_dim) fp32 are non-persistent buffers (not checkpointed),
    recomputed by :meth:`init_weights`.

    Shapes: forward(tokens (batch, seq) int64) -> logits (batch, seq, vocab_size), dtype of the
    output head's compute (fp32 unless mixed precision).
    """

    #: A Hugging Face ``save_pretrained`` folder :meth:`init_weights` reads (fine-tuning); None: random init.
    init_from: str | None = None

    def __init__(self, config: ModelConfig, init_from: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.init_from = init_from
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = model_rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With ``config.tie_embeddings``, make ``output.weight`` the same Parameter as
        ``tok_embeddings.weight``. Call after ``to_empty`` (materialization can untie them);
        a no-op when untied or already tied, or on a pipeline stage holding only one of the two."""
        if self.output is None or self.tok_embeddings is None:
            return
        if self.config.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
        """The tensor-parallel plan this model declares (see :func:`dense_decoder_tp_plan`).

        The strategy applies it with :func:`kempnerforge.parallel.tensor_parallel.apply_tp`.
        """
        return dense_decoder_tp_plan(self.config, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_chunk_size: int = 0,
        z_loss_weight: float = 0.0,
        doc_ids: torch.Tensor | None = None,
        loss_impl: str = "chunked",
        cp: ContextShard | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, seq, vocab_size) for ``tokens`` (batch, seq) at positions 0..seq-1.

        With ``labels`` (batch, seq) it returns instead ``(loss_sum, z_sum)``: the summed token
        cross-entropy plus ``z_loss_weight * z_sum`` (fp32 scalar, nats; ``-100`` labels ignored) and the
        summed squared log-normalizers, from the head fused with the loss: ``loss_impl="chunked"`` over
        chunks of ``loss_chunk_size`` tokens (0: the default size;
        :func:`kempnerforge.training.chunked_ce.chunked_linear_cross_entropy_sum`), ``"liger"`` with
        Liger-Kernel on CUDA (:func:`kempnerforge.training.loss_impl.liger_linear_cross_entropy_sum`). That
        runs inside ``forward`` so FSDP2 still holds the all-gathered head weight; the head module itself is
        not called (its weight is read), so it needs a plain, not vocab-sharded (TP), weight.

        ``doc_ids`` (batch, seq) int marks packed documents (:mod:`kempnerforge.data.packing`): no token
        attends across a document boundary (:func:`~kempnerforge.model.attention.document_attention_mask`);
        positions (RoPE) stay those of the window, as in torchtitan and Megatron-LM.

        ``cp`` (context parallelism, :func:`~kempnerforge.parallel.context_parallel.shard_batch`): ``tokens`` and
        ``labels`` are this cp rank's (batch, seq / cp) share at ``cp.positions``; RoPE rotates each token by its
        global position and attention masks by global positions and ``cp.doc_ids`` (``doc_ids`` must then be None).

        Raises:
            ValueError: if seq > config.max_seq_len (the RoPE tables end there); ``labels`` with a
                ``loss_impl`` other than ``chunked`` / ``liger``, a negative ``loss_chunk_size`` or a
                vocab-sharded head weight.
        """
        seq = tokens.shape[1] if cp is None else cp.seq_len
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds ModelConfig.max_seq_len={self.rope_cos.shape[0]}")
        if cp is None:
            rope = pack_rope(self.rope_cos[:seq], self.rope_sin[:seq])  # stays fp32 through bf16 blocks
            # Packed documents: one mask for every layer (a FlexAttention block mask on CUDA, the dense
            # (batch, 1, seq, seq) mask on CPU); None keeps the is_causal kernel.
            mask = None if doc_ids is None else document_attention_mask(doc_ids)
        else:
            if doc_ids is not None:
                raise ValueError("with cp, the whole sequence's doc_ids travel in cp.doc_ids; pass doc_ids=None")
            rope = pack_rope(self.rope_cos[cp.positions], self.rope_sin[cp.positions])
        h = self.tok_embeddings(tokens)
        if cp is not None:  # this rank's queries over every rank's keys, by global position; one for all blocks
            mask = cp.attention_mask(dtype=h.dtype)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if labels is None:
            return self.output(self.norm(h))
        return fused_head_loss(self.norm(h), self.output.weight, labels, loss_impl, loss_chunk_size, z_loss_weight)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter and the RoPE buffers in place; the model's only init.

        - RoPE tables: recomputed on CPU in fp32 and copied onto the buffers' device (bitwise the
          same on every device).
        - RMSNorm weights: ones.
        - Embedding / Linear weights and packed expert weights (``moe.experts.w1/w2/w3``): N(0,
          init_std**2) truncated at +-3 std; ``attention.wo``, ``feed_forward.w2`` and every expert's
          ``w2`` (routed and shared) use init_std / sqrt(2 * n_layers).
        - MoE router selection bias (``moe.router.expert_bias``) and q/k/v biases (``attention_bias``): zeros.
        Each weight is drawn from its own generator seeded from (seed, canonical FQN) on CPU, so the
        result is independent of the global RNG and identical for meta or eager builds and for any
        FSDP2/TP sharding (DTensors receive only their local shard). A tied embedding is initialized
        once, under the embedding's FQN.

        The rules live in :func:`~kempnerforge.model.decoder_init.init_decoder_` (shared with the VLM backbones).

        With ``init_from`` (a ``save_pretrained`` folder), every parameter is instead read from it, each rank only
        the elements it stores (:func:`~kempnerforge.checkpoint.hf_load.load_hf_weights_`).

        Raises:
            RuntimeError: if a parameter is not covered by the rules above (a new module type).
            KeyError, ValueError: ``init_from`` lacks a parameter, or holds one of another shape.
        """
        loaded = None
        init_from = getattr(self, "init_from", None)  # VLM backbones reuse this method without the attribute
        if init_from is not None:  # this rank's shards from the HF folder; RoPE tables and buffers below
            from kempnerforge.checkpoint.hf_load import load_hf_weights_

            loaded = load_hf_weights_(self, init_from, self.config)
        init_decoder_(self, self.config, seed, done=loaded)

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE modules by canonical FQN (``layers.1.moe``, ...), found through any wrapper
        (activation checkpointing, compile); empty for a dense model."""
        return {canonical_fqn(n): m for n, m in self.named_modules() if isinstance(m, MoE)}
