"""Per-block ``torch.compile``: compile each transformer block in place, after AC and before FSDP2.

As torchtitan v0.2 ``apply_compile``: compiling block by block (not the whole model) keeps graphs
small and identical across blocks, so one compiled graph serves every block of the same type
(dynamo's ``inline_inbuilt_nn_modules`` makes parameters graph inputs), and FSDP2's per-block
all-gather / reduce-scatter hooks stay outside the graphs. ``nn.Module.compile`` compiles in place:
the module keeps its class and FQNs (no ``_orig_mod`` prefix), so state-dict keys are unchanged.
"""

from __future__ import annotations

from torch import nn

from kempnerforge.parallel.contract import is_moe_layer
from kempnerforge.parallel.order import record_step


def apply_compile(model: nn.Module, enabled: bool = True, fullgraph: bool = True) -> list[str]:
    """Compile every block of ``model.layers`` in place with ``block.compile()`` (inductor backend).

    With ``enabled=False`` only the step's place in the chain is recorded.

    Compilation is lazy: the first forward of each distinct graph compiles (about 27 s cold on a 2-core
    CPU, a few seconds from a warm ``TORCHINDUCTOR_CACHE_DIR``).

    Args:
        model: a model with ``layers`` (``nn.ModuleDict`` / ``nn.ModuleList``), after activation
            checkpointing (a ``CheckpointWrapper`` block is compiled together with its recompute).
        enabled: compile (the strategy's ``compile`` argument).
        fullgraph: refuse graph breaks inside a block (a break would silently cost speed).

    Returns:
        Names (keys in ``model.layers``) of the compiled blocks (empty when not enabled).

    Raises:
        ValueError: ``model.layers`` missing or empty, or the model has MoE layers or other routed modules
            declaring ``data_dependent_shapes`` (MoMa's expert groups): ``fullgraph`` compilation of their
            blocks fails; use compile=False.
        TransformOrderError: compile applied twice, or after FSDP2.
    """
    record_step(model, "compile")
    if not enabled:
        return []
    # MoE layers and MoMa's expert-choice groups (``data_dependent_shapes``) route a data-dependent
    # number of rows to each expert.
    moe = [n for n, m in model.named_modules() if is_moe_layer(m) or getattr(m, "data_dependent_shapes", False)]
    if moe:
        raise ValueError(
            f"compile=True is not supported for MoE models ({len(moe)} MoE layers, e.g. {moe[0]}): token "
            "routing has data-dependent shapes that full-graph block compilation cannot trace; use compile=False."
        )
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict | nn.ModuleList) or len(layers) == 0:
        raise ValueError("per-block compile needs model.layers, a non-empty nn.ModuleDict or nn.ModuleList.")
    names = []
    for name, block in layers.named_children():
        block.compile(fullgraph=fullgraph)
        names.append(name)
    return names
