"""The tensor-parallel plan the dense decoder declares (the strategy decides whether to apply it).

Follows torchtitan v0.2 (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp``) and
Megatron-LM (Shoeybi et al., arXiv:1909.08053, sec. 3): in attention, Q/K/V are split column-wise
(by heads) and O row-wise; in the SwiGLU MLP, gate/up (``w1``/``w3``) column-wise and down
(``w2``) row-wise, so each block needs one all-reduce in forward and one in backward per sublayer.
The embedding is vocab-parallel (row-wise over the vocabulary) and the output head column-wise
(vocab-sharded logits, consumed by loss parallel). Optional sequence parallelism (Korthikanti et
al., arXiv:2205.05198) shards the norms' activations along the sequence and turns each all-reduce
into a reduce-scatter + all-gather pair.

MoE blocks (Mixture-of-Experts feed-forward, :mod:`kempnerforge.model.moe`) get their own block plan: attention
as above, the shared experts column/row-wise like the dense MLP, the router replicated, and the routed experts
sharded by expert-TP along their hidden channels
(:class:`~kempnerforge.parallel.expert_tensor_parallel.ExpertTensorParallel`, which documents the layout and why
it was chosen over token-split EP-over-TP); the layer's partial output is reduced once at its boundary, as
torchtitan's ``apply_moe_ep_tp`` does.

Keys are module FQNs relative to the model (``root``) or to each block of ``model.layers``
(``block``, or ``moe_block`` for blocks with an MoE layer); :func:`kempnerforge.parallel.tensor_parallel.apply_tp`
checks that every key matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from kempnerforge.config.model import ModelConfig
from kempnerforge.parallel.expert_tensor_parallel import ExpertTensorParallel


class VocabParallelEmbedding(RowwiseParallel):
    """``RowwiseParallel`` for the vocab-parallel ``nn.Embedding`` whose output reduction completes inside the module.

    ``RowwiseParallel`` reduces the partial lookup asynchronously: with ``use_local_output`` the embedding returns
    an ``AsyncCollectiveTensor`` (the wait deferred to its first use). Handed to a per-block compiled block, that
    tensor subclass becomes a graph input that AOT autograd unwraps, and in backward the gradient of the compiled
    block reaches the reduction's ``Redistribute`` backward as a plain tensor, bypassing the ``to_local`` node
    (torch 2.13: ``'Tensor' object has no attribute '_local_tensor'``). Waiting here costs nothing: the block's
    first op would wait at once. Shapes as ``RowwiseParallel`` on an embedding: ids ``(batch, seq)`` replicated in,
    ``(batch, seq, dim)`` (``Replicate``) or ``(batch, seq / tp, dim)`` (``Shard(1)``) out.
    """

    @staticmethod
    def _prepare_output_fn(
        output_layouts: tuple[Placement],
        use_local_output: bool,
        mod: nn.Module,
        outputs: DTensor,
        device_mesh: DeviceMesh,
    ) -> DTensor:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


@dataclass
class TPPlan:
    """A tensor-parallel plan split into the part applied to the root and the part applied per block.

    Attributes:
        root: FQN (relative to the model) -> style, e.g. ``{"tok_embeddings": VocabParallelEmbedding(...)}``.
        block: FQN (relative to each block of ``model.layers``) -> style, e.g. ``{"attention.wq": ...}``.
        moe_block: the plan of the blocks that hold an MoE layer (used instead of ``block`` there); empty for a
            dense model.
    """

    root: dict[str, ParallelStyle] = field(default_factory=dict)
    block: dict[str, ParallelStyle] = field(default_factory=dict)
    moe_block: dict[str, ParallelStyle] = field(default_factory=dict)


def dense_decoder_tp_plan(config: ModelConfig, *, sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
    """The TP plan of :class:`kempnerforge.model.Transformer` (torchtitan v0.2 ``apply_tp``).

    Activations between blocks (the residual stream, ``(batch, seq, dim)``) are replicated over the
    TP ranks, or with ``sequence_parallel`` sharded along ``seq`` (``(batch, seq / tp, dim)`` local),
    in which case RMSNorms run on sequence shards and attention / MLP inputs are all-gathered.

    - ``tok_embeddings``: vocab-parallel (:class:`VocabParallelEmbedding`, ``RowwiseParallel`` on ``nn.Embedding``
      with a synchronous output reduction: weight ``Shard(0)`` over vocab, replicated token ids in).
    - ``attention.wq/wk/wv``, ``feed_forward.w1/w3``: ``ColwiseParallel`` (weight ``Shard(0)``:
      each rank holds ``n_heads / tp`` query and ``n_kv_heads / tp`` KV heads, ``ffn_hidden / tp``
      MLP channels; with ``attention_bias`` the q/k/v biases are ``Shard(0)`` with their rows; ``head_dim`` need
      not be dim / n_heads). ``attention.wo``, ``feed_forward.w2``: ``RowwiseParallel`` (weight ``Shard(1)``).
    - With ``config.qk_norm``: ``q_norm``/``k_norm`` see only this rank's heads, so they are marked
      ``SequenceParallel(sequence_dim=2)`` (heads dim sharded): their weight is a replicated DTensor
      and its gradient is summed over the TP ranks (a plain parameter would keep a per-rank partial).
    - ``output``: ``ColwiseParallel``; with ``loss_parallel`` the logits stay a DTensor
      ``Shard(-1)`` over vocab (``(batch, seq, vocab / tp)`` local) for vocab-parallel
      cross-entropy, otherwise they are all-gathered into a plain ``(batch, seq, vocab)`` tensor.

    MoE blocks (``config.num_experts > 0``): ``moe_block`` (:func:`moe_block_tp_plan`). MLA attention
    (``config.attention == 'mla'``): :func:`mla_tp_plan` instead of the ``wq/wk/wv`` entries. Fused projections
    (``config.fuse_qkv`` / ``fuse_w13``): ``attention.wqkv`` / ``feed_forward.w13`` ``ColwiseParallel`` instead of
    the separate ones; their row layouts (:mod:`kempnerforge.model.fused`) make each rank's ``Shard(0)`` chunk hold
    whole KV groups (its query heads with their key and value head) / whole gate-up row pairs, biases included.

    A tied embedding/head works: both styles shard the one ``(vocab, dim)`` matrix as ``Shard(0)``,
    and :func:`~kempnerforge.parallel.tensor_parallel.apply_tp` re-ties them afterwards.

    Args:
        config: the model's config (reads ``qk_norm``).
        sequence_parallel: shard norms and the residual stream along ``seq`` (arXiv:2205.05198).
        loss_parallel: keep the logits vocab-sharded for loss parallel.

    Returns:
        A :class:`TPPlan`.
    """
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    root: dict[str, ParallelStyle] = {
        "tok_embeddings": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sp:
        root["norm"] = SequenceParallel()
        block["attention_norm"] = SequenceParallel()
        block["ffn_norm"] = SequenceParallel()
        # forward(x, cos, sin): all-gather x along seq; the RoPE tables are plain replicated tensors.
        block["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        block["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if config.attention == "mla":
        for name in ("wq", "wk", "wv"):
            del block[f"attention.{name}"]
        block.update(mla_tp_plan(config, sequence_parallel=sp))
    elif config.fuse_qkv:  # rows grouped per KV head: a Shard(0) chunk is whole KV groups (tp | n_kv_heads)
        for name in ("wq", "wk", "wv"):
            del block[f"attention.{name}"]
        block["attention.wqkv"] = ColwiseParallel()
    if config.fuse_w13:  # gate/up rows interleaved: a Shard(0) chunk is whole pairs (tp | ffn_hidden)
        del block["feed_forward.w1"], block["feed_forward.w3"]
        block["feed_forward.w13"] = ColwiseParallel()
    if config.qk_norm:
        block["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        block["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    moe_block = moe_block_tp_plan(config, block, sequence_parallel=sp) if config.num_experts > 0 else {}
    return TPPlan(root=root, block=block, moe_block=moe_block)


class LatentAttentionTensorParallel(ParallelStyle):
    """The style of a :class:`~kempnerforge.model.mla.MultiHeadLatentAttention` module itself under TP.

    Sets ``module.tp_mesh``: the shared RoPE key (``wkv_a``'s last ``qk_rope_head_dim`` outputs) feeds every head,
    and each rank holds only its own heads, so its gradient there is a partial sum over TP that the module reduces
    (:func:`~kempnerforge.parallel.expert_tensor_parallel.grad_all_reduce`). With ``sequence_parallel`` it also
    all-gathers the input ``x`` (batch, seq / tp, dim) along ``seq`` and hands it in as a plain (batch, seq, dim)
    tensor (the latent projections are plain replicated Linears).
    """

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.prepare = (
            PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            )
            if sequence_parallel
            else None
        )  # fmt: skip

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_mesh = device_mesh
        return module if self.prepare is None else self.prepare._apply(module, device_mesh)


def mla_tp_plan(config: ModelConfig, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The TP plan of :class:`~kempnerforge.model.mla.MultiHeadLatentAttention`, split over TP by heads.

    ``attention.wq`` (no query latent) or ``attention.wq_b``, and ``attention.wkv_b``: ``ColwiseParallel`` (each
    rank holds ``n_heads / tp`` heads' queries, keys and values; ``wo`` stays ``RowwiseParallel`` from the dense
    plan). ``wq_a``, ``wkv_a``, ``q_norm`` and ``kv_norm`` get no entry: they compute the latents from the whole
    input on every rank (replicated plain parameters, like the MoE router); the column-wise ``wq_b`` / ``wkv_b``
    all-reduce their input gradient, and the module reduces the shared RoPE key's
    (:class:`LatentAttentionTensorParallel` on ``attention``), so their gradients come out whole on every rank.
    """
    return {
        "attention": LatentAttentionTensorParallel(sequence_parallel),
        "attention.wq_b" if config.q_lora_rank else "attention.wq": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
    }


def moe_block_tp_plan(
    config: ModelConfig, dense_block: dict[str, ParallelStyle], *, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """The TP plan of a block whose feed-forward is :class:`~kempnerforge.model.moe.MoE` (module ``moe``).

    - Everything of ``dense_block`` except its ``feed_forward`` entries (attention, norms).
    - ``moe``: ``PrepareModuleInputOutput``: the input ``(batch, seq, dim)`` is made replicated (all-gathered along
      ``seq`` with sequence parallel) and handed in as a plain tensor; the output, a partial sum over TP, is
      all-reduced (reduce-scattered along ``seq`` with sequence parallel) back into the residual stream's layout.
      One reduction per MoE layer forward, like the dense feed-forward.
    - ``moe.experts``: :class:`~kempnerforge.parallel.expert_tensor_parallel.ExpertTensorParallel` (each expert's
      hidden channels split over TP; the tokens and their routing replicated).
    - ``moe.shared_experts.{i}.w1/w3``: ``ColwiseParallel``; ``w2``: ``RowwiseParallel`` with a ``Partial`` output,
      summed with the routed experts' partial output before the one reduction.
    - ``moe.router`` and ``moe.shared_gate``: no entry: replicated plain parameters computed on every TP rank
      (their gradients come out whole, see :mod:`kempnerforge.parallel.expert_tensor_parallel`).

    Args:
        config: the model's config (reads ``n_shared_experts``).
        dense_block: the dense block plan of :func:`dense_decoder_tp_plan`.
        sequence_parallel: the residual stream is sharded along ``seq`` (``Shard(1)``).

    Returns:
        FQN (relative to the block) -> style.
    """
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {k: v for k, v in dense_block.items() if not k.startswith("feed_forward")}
    plan["moe"] = PrepareModuleInputOutput(
        input_layouts=(residual,),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Partial(),),
        desired_output_layouts=(residual,),
        use_local_output=True,
    )
    plan["moe.experts"] = ExpertTensorParallel()
    for i in range(config.n_shared_experts):
        plan[f"moe.shared_experts.{i}.w1"] = ColwiseParallel()
        plan[f"moe.shared_experts.{i}.w2"] = RowwiseParallel(output_layouts=Partial())
        plan[f"moe.shared_experts.{i}.w3"] = ColwiseParallel()
    return plan
