"""Enforce the fixed order of the parallel transform chain: TP -> EP -> FP8 -> AC -> compile -> FSDP2.

Why the order is fixed is in DESIGN.md ("Why the order is fixed"): e.g. a TP plan applied after
FSDP2 matches wrapped modules and silently trains as data-parallel. Each ``apply_*`` function
records itself on the model; applying a step after a later one raises.
"""

from __future__ import annotations

from torch import nn

#: The chain, in the only order the strategy applies it.
CHAIN: tuple[str, ...] = ("tp", "ep", "float8", "activation_checkpoint", "compile", "fsdp")

_ATTR = "_kforge_applied_steps"


class TransformOrderError(RuntimeError):
    """A parallel transform applied out of order, or twice."""


def applied_steps(model: nn.Module) -> list[str]:
    """Names of the chain steps already applied to ``model``, in application order."""
    return list(getattr(model, _ATTR, []))


def record_step(model: nn.Module, step: str) -> None:
    """Record that ``step`` is being applied to ``model``.

    Raises:
        ValueError: ``step`` is not in :data:`CHAIN`.
        TransformOrderError: ``step`` was applied already, or a step after it in :data:`CHAIN` was.
    """
    if step not in CHAIN:
        raise ValueError(f"Unknown transform step {step!r}; the chain is {' -> '.join(CHAIN)}.")
    done = applied_steps(model)
    if step in done:
        raise TransformOrderError(f"Transform {step!r} was already applied to this model.")
    later = [s for s in done if CHAIN.index(s) > CHAIN.index(step)]
    if later:
        raise TransformOrderError(
            f"Cannot apply {step!r} after {later[0]!r}: the order is {' -> '.join(CHAIN)} "
            f"(already applied: {', '.join(done)})."
        )
    object.__setattr__(model, _ATTR, [*done, step])
