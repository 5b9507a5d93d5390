"""FP8 training through torchao float8 (``convert_to_float8_training``): Linear -> Float8Linear.

Follows the torchao float8 training docs (torchao/float8/README.md, torchao 0.18) and torchtitan v0.2
``Float8Converter``: dynamic scaling with a recipe chosen by name (``tensorwise``: one scale per
tensor, cuBLAS kernel, supports float8 all-gather in FSDP2; ``rowwise``: one scale per row, CUTLASS
kernel, power-of-2 scales), applied after TP / EP and before AC / FSDP2 so the filter still sees the
Linears by FQN. Skipped: MoE experts and routers (their grouped GEMMs / tiny gates), the output head
(logits precision), and Linears whose in or out features are not multiples of 16 (the FP8 GEMMs
need them). ``float8_all_gather`` makes FSDP2 all-gather tensorwise-scaled FP8 weights (half the
bytes of bf16).

FP8 together with tensor parallelism needs torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` styles and a GPU parity test; this build refuses ``tp > 1`` with FP8 at
validation (see :func:`validate_float8`).

torchao is the optional extra ``float8`` (``pip install 'kempnerforge[float8]'``); it installs without
touching torch.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util

from torch import nn

from kempnerforge.model.init import canonical_fqn
from kempnerforge.parallel.order import record_step

#: Oldest torchao whose float8 API (``Float8LinearConfig.from_recipe_name``) this module is tested with.
MIN_TORCHAO = (0, 18)

#: FQN components that mark modules FP8 must not convert (MoE expert banks and routers).
SKIP_FQN_PARTS: frozenset[str] = frozenset({"experts", "router"})

#: FQNs (canonical, without wrapper parts) of modules FP8 must not convert: the output head.
SKIP_FQNS: frozenset[str] = frozenset({"output"})

#: FP8 GEMMs need both matrix dims to be multiples of this.
FP8_DIM_MULTIPLE = 16


class Float8ConfigError(ValueError):
    """An FP8 setting that cannot run with the installed torchao or the chosen parallel degrees."""


def _torchao_version() -> tuple[int, ...] | None:
    if importlib.util.find_spec("torchao") is None:
        return None
    raw = importlib.metadata.version("torchao").split("+")[0]
    return tuple(int(p) for p in raw.split(".")[:2] if p.isdigit())


def available_recipes() -> list[str]:
    """Recipe names the installed torchao offers (``Float8LinearRecipeName`` values).

    Raises:
        Float8ConfigError: torchao is missing or older than :data:`MIN_TORCHAO`.
    """
    version = _torchao_version()
    if version is None or version < MIN_TORCHAO:
        found = "not installed" if version is None else "version " + ".".join(map(str, version))
        raise Float8ConfigError(
            f"float8_recipe needs torchao>={'.'.join(map(str, MIN_TORCHAO))} (found: {found}); install the "
            "extra: pip install 'kempnerforge[float8]' (torchao has no dependencies and leaves torch as is)."
        )
    from torchao.float8 import Float8LinearRecipeName

    return [r.value for r in Float8LinearRecipeName]


def validate_float8(recipe: str | None, all_gather: bool, tp: int = 1) -> None:
    """Check the FP8 settings before anything is allocated.

    Args:
        recipe: None (FP8 off) or a recipe name, e.g. ``"tensorwise"`` or ``"rowwise"``.
        all_gather: FSDP2 all-gathers FP8 weights (needs ``recipe="tensorwise"``).
        tp: tensor-parallel degree.

    Raises:
        Float8ConfigError: torchao missing/too old; ``recipe`` not offered by the installed torchao;
            ``all_gather`` without FP8 or with a non-tensorwise recipe; FP8 with ``tp > 1``.
    """
    if recipe is None:
        if all_gather:
            raise Float8ConfigError("float8_all_gather=True needs FP8: set float8_recipe='tensorwise'.")
        return
    recipes = available_recipes()
    if recipe not in recipes:
        raise Float8ConfigError(
            f"float8_recipe={recipe!r} is not a recipe of the installed torchao; choose one of {recipes} "
            "(or None to disable FP8)."
        )
    if all_gather and recipe != "tensorwise":
        raise Float8ConfigError(
            f"float8_all_gather=True needs float8_recipe='tensorwise' (torchao all-gathers only per-tensor "
            f"scaled weights); got float8_recipe={recipe!r}."
        )
    if tp > 1:
        raise Float8ConfigError(
            f"float8_recipe={recipe!r} with tp={tp} is not supported: FP8 + tensor parallelism needs torchao's "
            "Float8 parallel styles and a GPU parity test; use tp=1 or float8_recipe=None."
        )


def float8_module_filter(module: nn.Module, fqn: str) -> bool:
    """True when ``module`` (at ``fqn``) should become a ``Float8Linear``.

    A module converts when it is an ``nn.Linear``, its canonical FQN is not in :data:`SKIP_FQNS` (the
    output head), no FQN component is in :data:`SKIP_FQN_PARTS` (experts, routers), and both
    ``in_features`` and ``out_features`` are multiples of 16. Signature of torchao's ``module_filter_fn``.
    """
    if not isinstance(module, nn.Linear):
        return False
    name = canonical_fqn(fqn)
    if name in SKIP_FQNS or SKIP_FQN_PARTS.intersection(name.split(".")):
        return False
    return module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0


def apply_float8(model: nn.Module, recipe: str | None, all_gather: bool = False) -> list[str]:
    """Swap the eligible ``nn.Linear`` modules of ``model`` for torchao ``Float8Linear`` in place.

    Parameters keep their names and shapes (``Float8Linear`` subclasses ``nn.Linear``), so init and
    checkpoints are unchanged; the forward casts input, weight and grad_output to float8 with dynamic
    scales (e4m3 forward; tensorwise uses e5m2 for gradients).

    Args:
        model: meta or materialized model, after TP / EP and before AC / FSDP2.
        recipe: None (only records the step) or a name from :func:`available_recipes`.
        all_gather: with FSDP2, all-gather weights in float8 (tensorwise only).

    Returns:
        FQNs of the converted Linears.

    Raises:
        Float8ConfigError: as :func:`validate_float8` (tp is checked by the strategy), or FP8 requested
            but no Linear qualifies (FP8 would silently do nothing).
        TransformOrderError: FP8 applied twice or after AC / compile / FSDP2.
    """
    validate_float8(recipe, all_gather)
    record_step(model, "float8")
    if recipe is None:
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    chosen = [n for n, m in model.named_modules() if float8_module_filter(m, n)]
    if not chosen:
        raise Float8ConfigError(
            f"float8_recipe={recipe!r} converts no Linear: every Linear is skipped (head, experts, routers, or "
            f"in/out features not multiples of {FP8_DIM_MULTIPLE}); disable FP8."
        )
    convert_to_float8_training(model, module_filter_fn=float8_module_filter, config=config)
    return chosen
