"""Per-block ``torch.compile``: compile each transformer block in place, after AC and before FSDP2.

As torchtitan v0.2 ``apply_compile``: compiling block by block (not the whole model) keeps graphs
small and identical across blocks, so one compiled graph serves every block of the same type
(dynamo's ``inline_inbuilt_nn_modules`` makes parameters graph inputs), and FSDP2's per-block
all-gather / reduce-scatter hooks stay outside the graphs. ``nn.Module.compile`` compiles in place:
the module keeps its class and FQNs (no ``_orig_mod`` prefix), so state-dict keys are unchanged.

MoE blocks compile whole, without graph breaks (``fullgraph=True``), as torchtitan's do:

- routing, capacity dropping and the combine have fixed shapes (no host sync), and the grouped GEMM is one
  graph node (:mod:`kempnerforge.model.grouped_mm_op` for fp32, whose native fake kernel takes bf16 only);
- expert parallelism's all-to-all needs its split sizes as host integers (``.tolist()``, the one host sync
  per layer). We trace through it with ``torch._dynamo.config.capture_scalar_outputs`` (the sizes become
  unbacked symbols, the received row count a dynamic dim): one graph per block whatever the routing, no
  recompiles. The alternatives cost more: ``torch.compiler.disable`` on the dispatch would break every MoE
  block into three graphs, run the experts eagerly, and make a checkpointed block fall back to eager
  entirely (dynamo cannot trace a checkpoint region with a break inside); a custom op around the dispatch
  would need its own hand-written backward for the experts inside it.
- with expert parallelism, FSDP2 makes each MoE layer and its experts units of their own inside the block
  (:func:`~kempnerforge.parallel.fsdp.apply_fsdp`: one unit per block would deadlock the all-to-alls against its
  reduce-scatter), and FSDP2's hooks are ``torch._dynamo.disable``-d: a compiled block would break at them
  (``fullgraph`` refuses it; without it a checkpointed block falls back to eager whole). Such blocks are compiled
  piecewise, as torchtitan v0.2 did for MoE: attention, the norms, the router, the shared experts and their gate
  each compile in place (``fullgraph``); the MoE layer's own glue (counts, sort, gather, combine), the EP
  all-to-all and the experts' grouped GEMMs run eagerly between them. Activation checkpointing then stays eager
  around the block and recomputes through the compiled pieces. Dense blocks of the same model compile whole.
- ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``: an MoE layer records its
  ``aux_loss`` and ``stats`` as attributes. Eager checkpointing re-records them in the recomputation (same
  values); a compiled checkpointed block records them once, in forward, which is all the training loop reads.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from kempnerforge.parallel.contract import is_moe_layer
from kempnerforge.parallel.fsdp import block_inner_units
from kempnerforge.parallel.order import record_step

#: ``torch.compile`` backends the strategy's ``compile_backend`` accepts.
BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager")


def validate_compile(compile: bool, backend: str = "inductor") -> None:
    """Check the strategy's ``compile`` and ``compile_backend`` arguments before any rendezvous.

    Raises:
        ValueError: ``compile`` not a bool, or ``backend`` not one of :data:`BACKENDS`.
    """
    if not isinstance(compile, bool):
        raise ValueError(f"compile={compile!r} is not allowed; use True or False.")
    if backend not in BACKENDS:
        raise ValueError(f"compile_backend={backend!r} is not allowed; choose one of {list(BACKENDS)}.")


def apply_compile(
    model: nn.Module,
    enabled: bool = True,
    fullgraph: bool = True,
    backend: str = "inductor",
    expert_parallel: bool = False,
    tensor_parallel: bool = False,
) -> list[str]:
    """Compile every block of ``model.layers`` in place with ``block.compile()`` (piecewise around FSDP2 units).

    A block in which FSDP2 will make units of their own (with ``expert_parallel``: each MoE layer and its
    experts, :func:`~kempnerforge.parallel.fsdp.block_inner_units`) is compiled piecewise instead: its largest
    submodules that hold no such unit (attention, the norms, a dense feed-forward; inside the MoE layer the router,
    the shared experts and their gate), so FSDP2's hooks, the EP all-to-all and the grouped GEMM run eagerly
    between compiled pieces (see the module docstring).

    With ``enabled=False`` only the step's place in the chain is recorded. With MoE layers, two process-wide
    dynamo settings are switched on (see the module docstring); they change nothing for dense blocks.

    Compilation is lazy: the first forward of each distinct graph compiles (about 27 s cold for a dense
    block on a 2-core CPU, 35 s of CPU for an MoE block; a few seconds from a warm ``TORCHINDUCTOR_CACHE_DIR``).

    Args:
        model: a model with ``layers`` (``nn.ModuleDict`` / ``nn.ModuleList``), after EP and activation
            checkpointing (a ``CheckpointWrapper`` block is compiled together with its recompute).
        enabled: compile (the strategy's ``compile`` argument).
        fullgraph: refuse graph breaks inside a block (a break would silently cost speed).
        backend: ``torch.compile`` backend (``"inductor"``; tests use ``"aot_eager"`` to skip code generation).
        expert_parallel: ``ep > 1`` (FSDP2 will shard MoE layers and experts as units inside the blocks).
        tensor_parallel: ``tp > 1``: a block under full activation checkpointing (no selective policy) is compiled
            inside its ``CheckpointWrapper``, which stays eager and recomputes through the compiled block. Compiled
            whole, its recomputation graph takes the TP DeviceMesh as an input to save, which AOT autograd
            (torch 2.13) files among the saved tensors and refuses (``expected all tensors_saved_with_vc_check to
            be Tensors``); with a selective policy the compiled checkpoint works and is kept.

    Returns:
        Names of the compiled modules relative to ``model.layers``: a block's key (``"0"``), or for a block
        compiled piecewise its pieces (``"1.attention"``, ``"1.moe.router"``, ...); empty when not enabled.

    Raises:
        ValueError: ``model.layers`` missing or empty, or the model has modules declaring
            ``data_dependent_shapes`` (MoMa's expert-choice groups, not verified under compile).
        TransformOrderError: compile applied twice, or after FSDP2.
    """
    record_step(model, "compile")
    if not enabled:
        return []
    routed = [n for n, m in model.named_modules() if getattr(m, "data_dependent_shapes", False)]
    if routed:
        raise ValueError(
            f"compile=True is not supported for modules declaring data_dependent_shapes (MoMa's expert-choice "
            f"groups; {len(routed)}, e.g. {routed[0]}); use compile=False."
        )
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict | nn.ModuleList) or len(layers) == 0:
        raise ValueError("per-block compile needs model.layers, a non-empty nn.ModuleDict or nn.ModuleList.")
    if any(is_moe_layer(m) for m in model.modules()):
        torch._dynamo.config.capture_scalar_outputs = True  # EP split sizes as unbacked symbols
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True  # aux_loss / stats once
    options = {"fullgraph": fullgraph, "backend": backend}
    names = []
    for name, block in layers.named_children():
        units = {id(m) for m in block_inner_units(block, expert_parallel)}
        if not units:
            _full_ac_inner(block, tensor_parallel).compile(**options)
            names.append(name)
        else:
            # The router stays eager too: under AC its recomputation gets the forward's expert choice as an input,
            # a second graph saving other tensors than the first, which the eager checkpoint refuses.
            eager = {id(m.router) for m in block.modules() if is_moe_layer(m)}
            names += [f"{name}.{piece}" for piece in _compile_around(block, units, eager, options)]
    return names


def _compile_around(module: nn.Module, units: set[int], eager: set[int], options: dict) -> list[str]:
    """Compile in place every largest submodule of ``module`` that holds none of ``units`` (ids of modules that
    will be FSDP2 units), is not in ``eager`` (ids of modules left uncompiled) and is callable; return their names
    relative to ``module`` (CheckpointWrapper's ``_checkpoint_wrapped_module.`` prefix dropped, as in state-dict
    keys)."""
    names = []
    for name, child in module.named_children():
        holds_unit = any(id(m) in units for m in child.modules())
        if id(child) in eager:
            continue
        if holds_unit or isinstance(child, nn.ModuleDict | nn.ModuleList):  # containers have no forward
            names += [f"{name}.{piece}" for piece in _compile_around(child, units, eager, options)]
        else:
            child.compile(**options)
            names.append(name)
    return [n.removeprefix(_AC_PREFIX) for n in names]


_AC_PREFIX = "_checkpoint_wrapped_module."


def _full_ac_inner(block: nn.Module, tensor_parallel: bool) -> nn.Module:
    """The module to compile for ``block``: with ``tensor_parallel``, the wrapped block of a full-recompute
    ``CheckpointWrapper`` (no ``context_fn``); otherwise ``block`` itself (see :func:`apply_compile`)."""
    if not tensor_parallel or not isinstance(block, CheckpointWrapper):
        return block
    checkpoint_fn = getattr(block, "checkpoint_fn", None)
    if isinstance(checkpoint_fn, partial) and checkpoint_fn.keywords.get("context_fn") is not None:
        return block
    return block._checkpoint_wrapped_module
