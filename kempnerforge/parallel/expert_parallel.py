"""Expert parallelism (EP): the chain step that will repartition MoE expert lists over the ``ep`` mesh.

Its place in the chain is fixed now (TP -> **EP** -> FP8 -> AC -> compile -> FSDP2, see
:mod:`kempnerforge.parallel.order`): EP comes after TP, whose plan leaves MoE MLPs alone, and before
FP8, whose filter must still see the expert Linears by FQN to skip them. The body (token dispatch
with ``all_to_all_single``, experts sharded on ``Shard(0)`` of the expert mesh, as in torchtitan v0.2
``apply_moe_ep_tp``) arrives with the MoE issue. Until then ``ep > 1`` is refused by
:func:`kempnerforge.parallel.mesh.validate_degrees` before any process group exists.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from kempnerforge.parallel.order import record_step


def moe_layers(model: nn.Module) -> list[str]:
    """FQNs of the modules that declare themselves MoE layers (attribute ``is_moe = True``).

    The dense decoder has none; MoE blocks set ``is_moe`` when they land.
    """
    return [name for name, m in model.named_modules() if getattr(m, "is_moe", False)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh | None) -> None:
    """Expert-parallelize ``model`` in place over ``ep_mesh`` (the EP step of the chain).

    With ``ep_mesh`` of size 1 (or None) the experts stay whole on every rank, so the step only
    records its place in the chain: a later attempt to run TP raises
    :class:`~kempnerforge.parallel.order.TransformOrderError`.

    Args:
        model: the model (meta or materialized), after TP.
        ep_mesh: 1-D expert-parallel mesh, or None when ``ep == 1``.

    Raises:
        TransformOrderError: EP applied twice, or after FP8 / AC / compile / FSDP2.
        ValueError: ``ep_mesh`` has size > 1 but ``model`` has no MoE layer (``ep > 1`` needs MoE), or
            it has MoE layers (expert sharding arrives with the MoE issue; validation refuses
            ``ep > 1`` earlier, so reaching this is a programming error, not a silent no-op).
    """
    record_step(model, "ep")
    ep = 1 if ep_mesh is None else ep_mesh.size()
    if ep == 1:
        return
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"ep={ep} needs MoE layers, but the model has none; use ep=1.")
    raise ValueError(f"ep={ep}: expert sharding of {len(layers)} MoE layers is not available in this build; use ep=1.")
