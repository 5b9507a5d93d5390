"""The model contract :class:`~kempnerforge.strategies.KempnerStrategy` relies on, written down once.

The strategy builds, parallelizes and initializes any model that fulfils these ``typing.Protocol`` s; it checks
them once, before the chain runs (:func:`check_model_contract`), and raises one :class:`ModelContractError` that
names every missing member and what it is for, instead of an ``AttributeError`` from deep inside FSDP2 or TP.
The parallel ``apply_*`` functions test the optional capabilities with ``isinstance`` on the same protocols.

Required of the LightningModule (:class:`ParallelModule`): ``model`` (built on the meta device in
``configure_model``) and ``init_seed``. Optional: ``validate_parallel(dims)`` (:class:`ValidatesParallel`), the
module's own mesh rules, run before any process group or allocation.

Required of the model (:class:`ParallelModel`): ``layers`` (the blocks: FSDP2 units, activation checkpointing,
per-block compile, pipeline stages) and ``init_weights(seed)`` (the only init, after ``to_empty``; sharding
invariant). Optional capabilities: ``tp_plan(...)`` (:class:`DeclaresTPPlan`, required when ``tp > 1``),
``tie_weights()`` (:class:`TiesWeights`), ``fsdp_units()`` (:class:`DeclaresFSDPUnits`: further FSDP2 units such
as a VLM's encoder) and MoE layers, modules with ``is_moe = True`` and packed ``experts`` (:class:`MoELayer`).

Source: the contract torchtitan's ``parallelize_*`` functions assume of its models (``layers``,
``init_weights``), made explicit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

if TYPE_CHECKING:
    from kempnerforge.model.tp_plan import TPPlan
    from kempnerforge.parallel.mesh import ParallelDims


class ModelContractError(TypeError):
    """A LightningModule or model lacks what :class:`~kempnerforge.strategies.KempnerStrategy` needs."""


@runtime_checkable
class ParallelModel(Protocol):
    """A model the strategy can parallelize: its blocks and its own (sharding-invariant) init.

    Attributes:
        layers: the transformer blocks, ``nn.ModuleDict`` or ``nn.ModuleList``, in forward order.
    """

    layers: nn.ModuleDict | nn.ModuleList

    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter and buffer in place from ``seed`` (after ``to_empty``; DTensors get their
        shard); the result must not depend on the mesh."""


@runtime_checkable
class DeclaresTPPlan(Protocol):
    """A model with a tensor-parallel plan (:class:`~kempnerforge.model.tp_plan.TPPlan`); needed for ``tp > 1``."""

    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
        """The plan: root styles and per-block styles by FQN."""


@runtime_checkable
class TiesWeights(Protocol):
    """A model whose shared parameters (tied embedding and head) must be re-tied after ``to_empty`` and TP."""

    def tie_weights(self) -> None:
        """Make shared parameters one ``Parameter`` again (a no-op when untied)."""


@runtime_checkable
class DeclaresFSDPUnits(Protocol):
    """A model with FSDP2 units besides its blocks and decoder ends (e.g. a VLM's encoder layers and connector)."""

    def fsdp_units(self) -> list[nn.Module]:
        """The further units, inner before outer, in forward order."""


@runtime_checkable
class MoELayer(Protocol):
    """A Mixture-of-Experts layer: EP shards its packed ``experts``; FSDP2 makes them their own unit.

    Attributes:
        is_moe: True (the marker the chain looks for).
        experts: the packed expert weights (``w1``, ``w2``, ``w3`` of shape (num_experts, ...)).
    """

    is_moe: bool
    experts: nn.Module


def is_moe_layer(module: Any) -> bool:
    """Whether ``module`` declares itself an MoE layer (:class:`MoELayer` with ``is_moe`` true)."""
    return isinstance(module, MoELayer) and bool(module.is_moe)


@runtime_checkable
class ParallelModule(Protocol):
    """The LightningModule side: the model it builds in ``configure_model`` and the seed of its init.

    Attributes:
        model: the model (None before ``configure_model``).
        init_seed: seed passed to ``model.init_weights``.
    """

    model: nn.Module | None
    init_seed: int


@runtime_checkable
class ValidatesParallel(Protocol):
    """A LightningModule with model-specific mesh rules (``n_heads % tp``, MoE and VLM rules)."""

    def validate_parallel(self, dims: ParallelDims) -> None:
        """Raise ``MeshConfigError`` / ``ValueError`` for degrees the model cannot run."""


#: What each required member is for, as the error message says it.
_PURPOSE = {
    "model": "the nn.Module the strategy shards (build it on the meta device in configure_model)",
    "init_seed": "the seed of the model's init (an int)",
    "layers": "the transformer blocks (nn.ModuleDict or nn.ModuleList): FSDP2 units, AC, compile, pipeline stages",
    "init_weights": "init_weights(seed): the model's only init, run after to_empty on each rank's shard",
    "tp_plan": "tp_plan(sequence_parallel=..., loss_parallel=...) -> TPPlan, needed for tp > 1",
}


def check_module_contract(module: Any) -> None:
    """Check the LightningModule side (before ``configure_model``: only ``init_seed`` and the attribute ``model``).

    Raises:
        ModelContractError: naming the missing members and what they are for.
    """
    _raise_missing(type(module).__name__, [n for n in ("model", "init_seed") if not hasattr(module, n)])


def check_model_contract(model: Any, tp: int = 1) -> None:
    """Check the built model (after ``configure_model``, before the chain) against :class:`ParallelModel` and, for
    ``tp > 1``, :class:`DeclaresTPPlan`.

    Raises:
        ModelContractError: ``model`` is not an ``nn.Module``, or lacks members (all of them named at once).
    """
    if not isinstance(model, nn.Module):
        raise ModelContractError(
            f"KempnerStrategy needs the LightningModule's `model` to be an nn.Module after configure_model, got "
            f"{type(model).__name__}."
        )
    missing = [n for n in ("layers", "init_weights") if not hasattr(model, n)]
    if tp > 1 and not isinstance(model, DeclaresTPPlan):
        missing.append("tp_plan")
    _raise_missing(type(model).__name__, missing)


def _raise_missing(owner: str, missing: list[str]) -> None:
    if missing:
        needs = "; ".join(f"`{n}`: {_PURPOSE[n]}" for n in missing)
        raise ModelContractError(f"KempnerStrategy cannot parallelize {owner}: it lacks {needs}.")
