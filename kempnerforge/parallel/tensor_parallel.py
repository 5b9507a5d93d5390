"""Tensor parallelism with DTensor ``parallelize_module``: the first step of the chain.

Follows torchtitan v0.2 ``apply_tp`` (``torchtitan/models/llama3/infra/parallelize.py``) on top of
Megatron-LM's intra-layer split (Shoeybi et al., arXiv:1909.08053) and sequence parallelism
(Korthikanti et al., arXiv:2205.05198). The model declares its plan (``model.tp_plan(...)``, see
:mod:`kempnerforge.model.tp_plan`); this module validates the degrees, checks that every plan entry
matches a module, and applies it. A plan that matches nothing would leave the model replicated and
train as plain data parallelism with a normal-looking loss, so it is an error here, never a warning.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from kempnerforge.parallel.contract import DeclaresTPPlan, TiesWeights, is_moe_layer
from kempnerforge.parallel.mesh import MeshConfigError
from kempnerforge.parallel.order import record_step


def validate_tp(
    tp: int,
    *,
    n_heads: int,
    n_kv_heads: int,
    sequence_parallel: bool = False,
    seq_len: int | None = None,
) -> None:
    """Check a tensor-parallel degree against the model and the data before anything is allocated.

    Args:
        tp: tensor-parallel degree (>= 1).
        n_heads: query heads; each TP rank holds ``n_heads / tp`` of them.
        n_kv_heads: key/value heads; each TP rank holds ``n_kv_heads / tp`` of them.
        sequence_parallel: whether the residual stream is sharded along ``seq``.
        seq_len: training sequence length, tokens (None: not known, not checked).

    Raises:
        MeshConfigError: ``n_heads % tp``, ``n_kv_heads % tp``, or a rule of
            :func:`validate_sequence_parallel`.
    """
    validate_sequence_parallel(tp, sequence_parallel, seq_len)
    if n_heads % tp:
        raise MeshConfigError(
            f"tp={tp} must divide n_heads={n_heads}: each tensor-parallel rank holds n_heads / tp query heads."
        )
    if n_kv_heads % tp:
        raise MeshConfigError(
            f"tp={tp} must divide n_kv_heads={n_kv_heads}: each tensor-parallel rank holds n_kv_heads / tp "
            "key/value heads."
        )


def validate_sequence_parallel(tp: int, sequence_parallel: bool, seq_len: int | None = None) -> None:
    """Rules of sequence parallelism (arXiv:2205.05198) that need no model.

    Args:
        tp: tensor-parallel degree.
        sequence_parallel: whether the residual stream is sharded along ``seq``.
        seq_len: training sequence length, tokens (None: not known, not checked).

    Raises:
        MeshConfigError: ``sequence_parallel`` with ``tp=1``, or ``seq_len % tp`` with it.
    """
    if not sequence_parallel:
        return
    if tp == 1:
        raise MeshConfigError(
            "sequence_parallel=True needs tp > 1 (it shards activations over the tensor-parallel ranks); "
            "got tp=1. Set tp >= 2 or sequence_parallel=False."
        )
    if seq_len is not None and seq_len % tp:
        raise MeshConfigError(
            f"sequence_parallel=True needs seq_len divisible by tp: seq_len={seq_len}, tp={tp} "
            "(each rank holds seq_len / tp positions of the residual stream)."
        )


def _resolve(module: nn.Module, path: str) -> list[nn.Module]:
    """Modules matched by a plan key, token by token with ``fnmatch`` (the rule ``parallelize_module`` uses)."""
    found = [module]
    for token in path.split("."):
        found = [child for m in found for name, child in m.named_children() if fnmatch(name, token)]
    return found


def unmatched_plan_entries(module: nn.Module, plan: dict[str, ParallelStyle]) -> list[str]:
    """Plan keys that match no submodule of ``module`` (``parallelize_module`` would only warn)."""
    return [key for key in plan if key and not _resolve(module, key)]


def _has_moe(block: nn.Module) -> bool:
    return any(is_moe_layer(m) for m in block.modules())


def _pruned(model: nn.Module, fqn: str) -> bool:
    """``fqn`` names a module pipeline pruning removed: a None on its path (``backbone.tok_embeddings``) or a block
    of ``model.layers`` this stage does not hold (``backbone.layers.0``)."""
    node: nn.Module | None = model
    for part in fqn.split("."):
        if isinstance(node, nn.ModuleDict) and node is model.layers and part not in node:
            return True
        node = getattr(node, part, node) if node is not None else None
        if node is None:
            return True
    return False


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    float8_recipe: str | None = None,
    float8_all_gather: bool = False,
) -> None:
    """Shard ``model`` over ``tp_mesh`` in place with the plan the model declares.

    ``model.tp_plan(sequence_parallel=..., loss_parallel=...)`` returns a
    :class:`~kempnerforge.model.tp_plan.TPPlan`: ``root`` is applied to ``model``, ``block`` to every
    block of ``model.layers`` and ``moe_block`` instead to the blocks that hold an MoE layer (router
    replicated, routed experts expert-TP, :mod:`kempnerforge.parallel.expert_tensor_parallel`). Parameters become DTensors on ``tp_mesh`` (meta tensors stay on
    meta; the strategy materializes and initializes afterwards). A tied embedding/head is re-tied
    (``model.tie_weights()``), which is exact because both styles shard the ``(vocab, dim)`` matrix
    as ``Shard(0)``.

    Shapes: ``model(tokens (batch, seq))`` then returns logits ``(batch, seq, vocab)``: a DTensor
    ``Shard(-1)`` over vocab with ``loss_parallel``, else a plain tensor.

    Source: torchtitan v0.2 ``apply_tp``; Megatron-LM arXiv:1909.08053; sequence parallel
    arXiv:2205.05198.

    Args:
        model: a module with ``layers`` (``nn.ModuleDict`` / ``nn.ModuleList``) and ``tp_plan``; raw
            modules (no AC / Float8 / FSDP wrappers yet). Root plan entries whose top-level module is
            None (removed by pipeline-stage pruning) are skipped.
        tp_mesh: 1-D tensor-parallel DeviceMesh.
        sequence_parallel: shard the residual stream and norms along ``seq``.
        loss_parallel: keep the logits vocab-sharded (the loss must then run under ``loss_parallel()``,
            see :func:`kempnerforge.training.loss.global_token_cross_entropy`).
        float8_recipe: the FP8 recipe the chain will use (None: off). The Linears the plan shards are
            converted to ``Float8Linear`` just before sharding and get torchao's float8 styles
            (:func:`kempnerforge.parallel.float8.float8_tp_plan`); the FP8 step converts the rest later.
        float8_all_gather: the FP8 step's ``all_gather`` (FSDP2 float8 all-gather, tensorwise).

    Raises:
        TransformOrderError: TP applied twice, or after a later step of the chain (FSDP2, AC, ...).
        TypeError: ``model`` declares no ``tp_plan``.
        ValueError: a plan entry matches no module (names the entries), or the plan is empty.
    """
    record_step(model, "tp")
    if not isinstance(model, DeclaresTPPlan):
        raise TypeError(f"{type(model).__name__} declares no tp_plan(); tensor parallelism cannot be applied.")
    plan = model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    # A pipeline stage's model holds None where another stage owns the module (embedding, norm, head;
    # kempnerforge.parallel.pipeline.prune_to_stages): those root entries are skipped, not "unmatched"
    # (a name the model lacks altogether gets the non-None default and is reported below).
    plan.root = {k: v for k, v in plan.root.items() if not _pruned(model, k)}
    blocks = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    if not plan.root and not plan.block:
        raise ValueError(f"{type(model).__name__}.tp_plan() is empty: tensor parallelism would do nothing.")
    missing = [f"root:{k}" for k in unmatched_plan_entries(model, plan.root)]
    names = list(model.layers.keys()) if isinstance(model.layers, nn.ModuleDict) else range(len(blocks))
    # An MoE block without a moe_block plan keeps the dense one, whose feed_forward keys then fail to match.
    block_plans = [plan.moe_block if plan.moe_block and _has_moe(b) else plan.block for b in blocks]
    for name, block, block_plan in zip(names, blocks, block_plans, strict=True):
        missing += [f"layers.{name}.{k}" for k in unmatched_plan_entries(block, block_plan)]
    if missing:
        raise ValueError(
            f"Tensor-parallel plan entries matched no module: {missing}. The model would silently train "
            "as data parallel; fix the plan's FQNs (TP must run before activation checkpointing, Float8 "
            "and FSDP2 wrap or rename modules)."
        )
    if float8_recipe is not None:  # Float8Linear before sharding: torchao's float8 styles shard a Float8Linear
        from kempnerforge.parallel.float8 import float8_tp_plan

        tp, ag = tp_mesh.size(), float8_all_gather
        plan.root = float8_tp_plan(model, plan.root, float8_recipe, tp=tp, all_gather=ag)
        block_plans = [
            float8_tp_plan(b, bp, float8_recipe, tp=tp, all_gather=ag, prefix=f"layers.{n}.")
            for n, b, bp in zip(names, blocks, block_plans, strict=True)
        ]
    parallelize_module(model, tp_mesh, plan.root)
    for block, block_plan in zip(blocks, block_plans, strict=True):
        parallelize_module(block, tp_mesh, block_plan)
    if isinstance(model, TiesWeights):
        model.tie_weights()
