"""Activation checkpointing (AC) of transformer blocks: full, every N-th block, or op-level selective.

Follows torchtitan v0.2 ``apply_ac`` and "Reducing Activation Recomputation in Large Transformer
Models" (Korthikanti et al., arXiv:2205.05198): a checkpointed block keeps only its input during the
forward pass and re-runs its forward in the backward pass to rebuild the activations.

Modes (strategy argument ``activation_checkpointing``):

- ``"none"``: nothing is wrapped (the step still records its place in the chain).
- ``"full"``: every block of ``model.layers`` is checkpointed.
- ``"selective"``: every ``ac_every_n``-th block (blocks ``n-1, 2n-1, ...`` in ``model.layers``
  order; ``ac_every_n=1`` equals ``"full"``), trading memory for less recompute.
- ``"selective_op"``: every block is wrapped, but the outputs of the expensive ops in
  :data:`SAVED_OPS` (matmuls, SDPA and FlexAttention, router top-k, TP reduce-scatter) are saved and only
  the cheap rest (norms, activations, RoPE, elementwise) is recomputed, through
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (the paper's "selective
  activation recomputation", done per op as in torchtitan's ``op`` option). FlexAttention (packed
  documents on CUDA) is saved where the policy sees its higher-order op: in a compiled block (``compile``,
  AOTAutograd applies the policy to the block's graph) and in an eager call. An eager block calls the
  separately compiled FlexAttention kernel (:func:`~kempnerforge.model.attention.attend`), which eager
  checkpointing cannot see into, so there it is still recomputed (inductor's
  ``wrap_inductor_compiled_regions`` would expose it; torchtitan turned that off over a PyTorch
  regression, pytorch/torchtitan#2463).

The step must run after TP / EP / FP8 (they match raw modules by name) and before compile and FSDP2
(wrapping after FSDP2 owns the parameters breaks its buckets). Every block in ``model.layers`` must be
of a type registered in :data:`CHECKPOINTABLE_BLOCKS`; an unknown type raises instead of being
skipped silently, so new block types (MoE, VLM) must register themselves.

``checkpoint_wrapper`` inserts ``_checkpoint_wrapped_module`` into parameter FQNs; its own
state-dict hooks and DCP's ``get_model_state_dict`` strip it, and init uses
:func:`kempnerforge.model.init.canonical_fqn`, so checkpoints and init are the same with or without AC.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# Private module, no public equivalent: its wrapper strips its own FQN prefix from state dicts (DCP relies on it).
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from kempnerforge.model.transformer import TransformerBlock
from kempnerforge.parallel.contract import is_moe_layer
from kempnerforge.parallel.order import record_step

#: Allowed values of ``activation_checkpointing``.
AC_MODES: tuple[str, ...] = ("none", "full", "selective", "selective_op")

#: Block types the AC step knows how to wrap. A block of any other type makes :func:`apply_ac` raise.
#: New block types (MoE, VLM) add themselves with :func:`register_checkpointable_block`.
CHECKPOINTABLE_BLOCKS: set[type[nn.Module]] = {TransformerBlock}


def _ops(*names: str) -> frozenset:
    """Resolve ``"namespace.op.overload"`` names to op overloads, and ``"higher_order.op"`` names to
    higher-order operators (no overloads), dropping those this torch build lacks."""
    found = []
    for name in names:
        ns, op, *overload = name.split(".")
        target = getattr(getattr(torch.ops, ns, None), op, None)
        if target is not None and overload:
            target = getattr(target, overload[0], None)
        if target is not None:
            found.append(target)
    return frozenset(found)


#: Ops whose outputs ``selective_op`` saves (everything else is recomputed). As torchtitan's
#: ``_op_sac_save_list``: matmuls (``mm``, ``addmm``, float8 ``_scaled_mm``), every SDPA kernel (CPU flash,
#: CUDA flash / efficient / cuDNN), FlexAttention (packed documents on CUDA: the ``flex_attention``
#: higher-order operator, as a compiled block's graph and an eager call show it), the MoE router's ``topk``
#: and ``max`` (float8 amax), and TP's sequence-parallel ``reduce_scatter_tensor`` (recomputing it would
#: repeat a collective).
SAVED_OPS: frozenset = _ops(
    "aten.mm.default",
    "aten.addmm.default",
    "aten._scaled_mm.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "higher_order.flex_attention",
    "aten.topk.default",
    "aten.max.default",
    "_c10d_functional.reduce_scatter_tensor.default",
)


def register_checkpointable_block(block_type: type[nn.Module]) -> type[nn.Module]:
    """Declare that blocks of ``block_type`` may be wrapped by :func:`apply_ac` (usable as a decorator).

    Returns:
        ``block_type`` unchanged.
    """
    CHECKPOINTABLE_BLOCKS.add(block_type)
    return block_type


def validate_ac(mode: str, every_n: int) -> None:
    """Check the AC arguments before anything is allocated.

    Raises:
        ValueError: ``mode`` not in :data:`AC_MODES`, or ``every_n`` not an integer >= 1.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not allowed; choose one of {list(AC_MODES)}.")
    if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
        raise ValueError(f"ac_every_n={every_n!r} is not allowed: use an integer >= 1 (1 checkpoints every block).")


def _save_matmul_attention_topk(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: save outputs of :data:`SAVED_OPS`, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_op_context_fn():
    """Fresh ``(forward, recompute)`` context pair for one checkpointed call (``context_fn`` of
    ``checkpoint_wrapper``): see ``torch.utils.checkpoint.create_selective_checkpoint_contexts``."""
    return create_selective_checkpoint_contexts(_save_matmul_attention_topk)


def _named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict | nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            "activation checkpointing needs model.layers, a non-empty nn.ModuleDict or nn.ModuleList of blocks; "
            f"got {type(layers).__name__}."
        )
    return list(layers.named_children())


def wrap_block(block: nn.Module, context_fn: Callable | None = None) -> CheckpointWrapper:
    """Wrap one block in a non-reentrant ``checkpoint_wrapper`` (torch.utils.checkpoint, use_reentrant=False).

    ``preserve_rng_state=False`` as in torchtitan: the decoder has no dropout, so the recomputed forward
    needs no RNG replay (a block type with dropout must not be registered without revisiting this).
    """
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False, **kwargs)


def apply_ac(model: nn.Module, mode: str = "none", every_n: int = 2) -> list[str]:
    """Checkpoint the blocks of ``model.layers`` in place (replacing each chosen block by its wrapper).

    Args:
        model: a model with ``layers`` (``nn.ModuleDict`` or ``nn.ModuleList``) of blocks of the types
            in :data:`CHECKPOINTABLE_BLOCKS`; meta or materialized; after TP/EP/FP8, before compile/FSDP2.
        mode: one of :data:`AC_MODES`.
        every_n: with ``mode="selective"``, checkpoint blocks whose 1-based position is a multiple of
            ``every_n``.

    Returns:
        Names (keys in ``model.layers``) of the wrapped blocks, in order.

    Raises:
        ValueError: bad ``mode`` / ``every_n`` (see :func:`validate_ac`), no ``model.layers``, or a
            block whose type is not registered (it would otherwise be skipped silently), or a block
            that is already checkpoint-wrapped.
        TransformOrderError: AC applied twice or after compile / FSDP2.
    """
    validate_ac(mode, every_n)
    record_step(model, "activation_checkpoint")
    blocks = _named_blocks(model)
    # Check every block before wrapping any: an unknown type fails the whole step, with no half-wrapped model.
    for name, block in blocks:
        if isinstance(block, CheckpointWrapper):
            raise ValueError(f"model.layers[{name!r}] is already checkpoint-wrapped.")
        if type(block) not in CHECKPOINTABLE_BLOCKS:
            known = sorted(t.__name__ for t in CHECKPOINTABLE_BLOCKS)
            raise ValueError(
                f"activation checkpointing does not know block type {type(block).__name__} "
                f"(model.layers[{name!r}]); known types: {known}. Register it with "
                "kempnerforge.parallel.activation_checkpoint.register_checkpointable_block."
            )
    if mode == "none":
        return []
    wrapped = []
    for position, (name, block) in enumerate(blocks, start=1):
        if mode == "selective" and position % every_n:
            continue
        context_fn = selective_op_context_fn if mode == "selective_op" else None
        model.layers.register_module(name, wrap_block(block, context_fn))
        wrapped.append(name)
        for module in block.modules():  # MoE layers keep their routing for the recomputation
            if is_moe_layer(module):
                module.save_routing = True
    return wrapped


def unwrap_block(block: nn.Module) -> nn.Module:
    """The block inside a ``CheckpointWrapper`` (or ``block`` itself when it is not wrapped)."""
    return block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
