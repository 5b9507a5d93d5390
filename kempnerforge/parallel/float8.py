"""FP8 training through torchao float8 (``convert_to_float8_training``): Linear -> Float8Linear.

Follows the torchao float8 training docs (torchao/float8/README.md, torchao 0.18) and torchtitan v0.2
``Float8Converter``: dynamic scaling with a recipe chosen by name (``tensorwise``: one scale per
tensor, cuBLAS kernel, supports float8 all-gather in FSDP2; ``rowwise``: one scale per row, CUTLASS
kernel, power-of-2 scales), applied after TP / EP and before AC / FSDP2 so the filter still sees the
Linears by FQN. Skipped: MoE experts and routers (their grouped GEMMs / tiny gates), the output head
(logits precision), and Linears whose in or out features are not multiples of 16 (the FP8 GEMMs
need them). ``float8_all_gather`` makes FSDP2 all-gather tensorwise-scaled FP8 weights (half the
bytes of bf16).

With tensor parallelism (``tp > 1``) the Linears the TP plan shards are converted inside the TP step,
just before they are sharded (:func:`float8_tp_plan`, called by
:func:`~kempnerforge.parallel.tensor_parallel.apply_tp`): torchao's float8 parallel styles take a
``Float8Linear``, and a swap after TP would drop the forward hooks TP put on the old module (the next
forward then fails with "got mixed torch.Tensor and DTensor"). This is torchtitan's order (convert, then
the float8 TP plan) folded into our chain: the FP8 step keeps its place after TP / EP, converts the
Linears TP left alone and records itself, so :mod:`kempnerforge.parallel.order` still refuses any step out
of order. Per recipe:

- ``tensorwise``: ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput``
  (torchao ``float8_tensor_parallel``): activations are cast to float8 before TP's all-gather (sequence
  parallel) and gradients before their reduce-scatter, so those collectives move float8 bytes.
- ``rowwise`` / ``rowwise_with_gw_hp``: torchao has no float8 TP styles for row-wise scales (its styles cast
  tensor-wise); the stock DTensor styles shard the ``Float8Linear`` and TP's collectives stay in high
  precision, as in torchtitan. Nothing is refused.

Scales are exact under TP: amax of a sharded DTensor weight / activation / gradient is reduced over the TP
ranks (a ``Partial(max)`` DTensor), so every rank quantizes with the scale one process would use. A TP
Linear converts only when its local GEMM dims (``out / tp`` column-wise, ``in / tp`` row-wise) are still
multiples of 16.

torchao is the optional extra ``float8`` (``pip install 'kempnerforge[float8]'``); it installs without
touching torch.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from fnmatch import fnmatch
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

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

#: Recipe whose scales torchao's float8 TP styles implement (they cast activations and gradients per tensor).
FLOAT8_TP_STYLE_RECIPE = "tensorwise"

# The recipe / all-gather setting the TP step converted with; the FP8 step must use the same.
_TP_SETTING_ATTR = "_kforge_float8_tp_setting"


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


def validate_float8(recipe: str | None, all_gather: bool) -> None:
    """Check the FP8 settings before anything is allocated.

    Every recipe composes with tensor parallelism (see the module docstring), so no parallel degree is
    checked here.

    Args:
        recipe: None (FP8 off) or a recipe name, e.g. ``"tensorwise"`` or ``"rowwise"``.
        all_gather: FSDP2 all-gathers FP8 weights (needs ``recipe="tensorwise"``).

    Raises:
        Float8ConfigError: torchao missing/too old; ``recipe`` not offered by the installed torchao;
            ``all_gather`` without FP8 or with a non-tensorwise recipe.
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


def validate_float8_collectives(recipe: str | None, tp: int, sequence_parallel: bool, backend: str | None) -> None:
    """Refuse FP8 collectives the process-group backend cannot carry, before the rendezvous.

    With ``recipe="tensorwise"``, ``tp > 1`` and sequence parallelism, torchao's float8 TP styles all-gather
    the activations as float8 tensors; gloo has no float8 dtypes (``Invalid scalar type`` mid-step), NCCL has.

    Args:
        recipe: the strategy's ``float8_recipe`` (None: FP8 off).
        tp: tensor-parallel degree.
        sequence_parallel: the strategy's ``sequence_parallel``.
        backend: the process-group backend the run will use (``"gloo"``, ``"nccl"``, ...; None: unknown).

    Raises:
        Float8ConfigError: tensorwise FP8 with ``tp > 1`` and sequence parallel on gloo.
    """
    if recipe == "tensorwise" and tp > 1 and sequence_parallel and backend == "gloo":
        raise Float8ConfigError(
            f"float8_recipe='tensorwise' with tp={tp} and sequence_parallel=True needs NCCL (CUDA): gloo cannot "
            "all-gather float8 activations; use float8_recipe='rowwise', sequence_parallel=False, or a GPU run."
        )


def float8_module_filter(module: nn.Module, fqn: str, *, out_shards: int = 1, in_shards: int = 1) -> bool:
    """True when ``module`` (at ``fqn``) should become a ``Float8Linear``.

    A module converts when it is an ``nn.Linear`` (not already a ``Float8Linear``, and not sharded by TP
    already: a swap would drop TP's hooks), its canonical FQN is not in :data:`SKIP_FQNS` (the output head),
    no FQN component is in :data:`SKIP_FQN_PARTS` (experts, routers), and both local GEMM dims,
    ``out_features / out_shards`` and ``in_features / in_shards``, are multiples of 16. Signature of torchao's
    ``module_filter_fn`` (with the shard counts a TP plan gives a Linear: ``out_shards=tp`` column-wise,
    ``in_shards=tp`` row-wise).
    """
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear):
        return False
    if isinstance(module.weight, DTensor):
        return False
    name = canonical_fqn(fqn)
    # A VLM's decoder lives under "backbone." (kempnerforge.model.vlm.model): its head is skipped as the text one.
    if name.removeprefix("backbone.") in SKIP_FQNS or SKIP_FQN_PARTS.intersection(name.split(".")):
        return False
    if module.out_features % out_shards or module.in_features % in_shards:
        return False
    out_local, in_local = module.out_features // out_shards, module.in_features // in_shards
    return out_local % FP8_DIM_MULTIPLE == 0 and in_local % FP8_DIM_MULTIPLE == 0


def _float8_config(recipe: str, all_gather: bool) -> Any:
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True) if all_gather else config


def _matches(name: str, key: str) -> bool:
    """``name`` is matched by plan key ``key`` token by token with ``fnmatch`` (``parallelize_module``'s rule)."""
    names, keys = name.split("."), key.split(".")
    return len(names) == len(keys) and all(fnmatch(n, k) for n, k in zip(names, keys, strict=True))


def _float8_style(style: ParallelStyle) -> ParallelStyle:
    """torchao's float8 counterpart of a stock Colwise / Rowwise style, with the same layouts."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
    return cls(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )


def _float8_prepare_input(style: PrepareModuleInput) -> ParallelStyle:
    """``PrepareFloat8ModuleInput`` with the layouts of a stock ``PrepareModuleInput``: the input is cast to
    float8 before it is redistributed (all-gathered), once for every float8 consumer."""
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

    return PrepareFloat8ModuleInput(
        input_layouts=style.input_layouts,
        desired_input_layouts=style.desired_input_layouts,
        input_kwarg_layouts=style.input_kwarg_layouts or None,
        desired_input_kwarg_layouts=style.desired_input_kwarg_layouts or None,
        use_local_output=style.use_local_output,
    )


def float8_tp_plan(
    module: nn.Module,
    plan: dict[str, ParallelStyle],
    recipe: str,
    *,
    tp: int,
    all_gather: bool = False,
    prefix: str = "",
) -> dict[str, ParallelStyle]:
    """Convert the Linears a TP plan shards to ``Float8Linear`` in place and return the plan to shard them with.

    Called by :func:`~kempnerforge.parallel.tensor_parallel.apply_tp` once for the root plan and once per
    block, before ``parallelize_module``. A Linear targeted by a stock ``ColwiseParallel`` / ``RowwiseParallel``
    converts when :func:`float8_module_filter` accepts it with its TP shard counts. With
    ``recipe="tensorwise"`` its style becomes torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``
    (same layouts), and a ``PrepareModuleInput`` becomes ``PrepareFloat8ModuleInput`` when every Linear inside
    that module which reads its input (every one not sharded row-wise) converted; other recipes keep the stock
    styles (TP collectives in high precision: torchao has no row-wise float8 TP styles). Source: torchtitan
    v0.2 ``apply_tp`` (``enable_float8_tensorwise_tp``), torchao ``float8_tensor_parallel``.

    Args:
        module: the model (root plan) or one block (block plan), not yet sharded.
        plan: FQN (relative to ``module``) -> style.
        recipe: a recipe of :func:`available_recipes`.
        tp: tensor-parallel degree (the shard count of sharded GEMM dims).
        all_gather: FSDP2 will all-gather the weights in float8 (tensorwise).
        prefix: FQN of ``module`` in the model plus a dot (``"layers.0."``), so the head / expert / router
            skips see canonical FQNs.

    Returns:
        A new plan: the same keys, float8 styles where they apply.

    Raises:
        Float8ConfigError: as :func:`validate_float8`.
    """
    validate_float8(recipe, all_gather)
    from torchao.float8 import convert_to_float8_training

    shards = {ColwiseParallel: (tp, 1), RowwiseParallel: (1, tp)}
    named = dict(module.named_modules())
    chosen: dict[str, str] = {}  # module FQN -> plan key
    rowwise_targets: set[str] = set()
    for key, style in plan.items():
        for name, sub in named.items():
            if not name or not _matches(name, key) or type(style) not in shards:
                continue
            if type(style) is RowwiseParallel:
                rowwise_targets.add(name)
            out_shards, in_shards = shards[type(style)]
            if float8_module_filter(sub, prefix + name, out_shards=out_shards, in_shards=in_shards):
                chosen[name] = key
    if chosen:
        convert_to_float8_training(
            module, module_filter_fn=lambda _, fqn: fqn in chosen, config=_float8_config(recipe, all_gather)
        )
    object.__setattr__(module, _TP_SETTING_ATTR, (recipe, all_gather))
    if recipe != FLOAT8_TP_STYLE_RECIPE:
        return dict(plan)
    # One style object serves every module a key matches: it turns float8 only if all of them converted.
    matched = {key: [n for n in named if n and _matches(n, key)] for key in plan}
    converted_keys = {key for key, names in matched.items() if names and all(n in chosen for n in names)}
    out: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if key in converted_keys:
            out[key] = _float8_style(style)
        elif type(style) is PrepareModuleInput and _reads_only_float8(module, key, rowwise_targets):
            out[key] = _float8_prepare_input(style)
        else:
            out[key] = style
    return out


def _reads_only_float8(module: nn.Module, key: str, rowwise_targets: set[str]) -> bool:
    """Every module ``key`` matches holds Linears, and each one not sharded row-wise is a ``Float8Linear``."""
    from torchao.float8.float8_linear import Float8Linear

    targets = [(name, sub) for name, sub in module.named_modules() if name and _matches(name, key)]
    if not targets:
        return False
    for name, sub in targets:
        readers = [
            m for n, m in sub.named_modules(prefix=name) if isinstance(m, nn.Linear) and n not in rowwise_targets
        ]
        if not readers or not all(isinstance(m, Float8Linear) for m in readers):
            return False
    return True


def apply_float8(model: nn.Module, recipe: str | None, all_gather: bool = False) -> list[str]:
    """Swap the eligible ``nn.Linear`` modules of ``model`` for torchao ``Float8Linear`` in place.

    Top-level modules the model names in ``float8_skip_roots`` (a VLM's ``encoder`` and ``connector`` unless
    ``float8_vision``) are left in high precision.

    Parameters keep their names and shapes (``Float8Linear`` subclasses ``nn.Linear``), so init and
    checkpoints are unchanged; the forward casts input, weight and grad_output to float8 with dynamic
    scales (e4m3 forward; tensorwise uses e5m2 for gradients). With ``tp > 1`` the TP step already converted
    the Linears it sharded (:func:`float8_tp_plan`); this step converts the rest (Linears outside the plan)
    and leaves TP-sharded Linears the TP step kept in high precision as they are.

    Args:
        model: meta or materialized model, after TP / EP and before AC / FSDP2.
        recipe: None (only records the step) or a name from :func:`available_recipes`.
        all_gather: with FSDP2, all-gather weights in float8 (tensorwise only).

    Returns:
        FQNs of every ``Float8Linear`` in ``model`` (converted here or by the TP step).

    Raises:
        Float8ConfigError: as :func:`validate_float8`; the TP step converted with another recipe /
            all-gather setting; or FP8 requested but no Linear qualifies (FP8 would silently do nothing).
        TransformOrderError: FP8 applied twice or after AC / compile / FSDP2.
    """
    validate_float8(recipe, all_gather)
    record_step(model, "float8")
    tp_settings = {getattr(m, _TP_SETTING_ATTR) for m in model.modules() if hasattr(m, _TP_SETTING_ATTR)}
    if tp_settings - {(recipe, all_gather)}:
        raise Float8ConfigError(
            f"float8_recipe={recipe!r}, float8_all_gather={all_gather} differ from what the TP step converted "
            f"with {sorted(tp_settings, key=str)}; pass the same settings to apply_tp and apply_float8."
        )
    if recipe is None:
        return []
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    skip_roots = tuple(getattr(model, "float8_skip_roots", ()))  # a VLM's vision tower and connector, by default

    def eligible(module: nn.Module, fqn: str) -> bool:
        return canonical_fqn(fqn).split(".")[0] not in skip_roots and float8_module_filter(module, fqn)

    if any(eligible(m, n) for n, m in model.named_modules()):
        convert_to_float8_training(model, module_filter_fn=eligible, config=_float8_config(recipe, all_gather))
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    if not converted:
        raise Float8ConfigError(
            f"float8_recipe={recipe!r} converts no Linear: every Linear is skipped (head, experts, routers, or "
            f"in/out features (per TP shard) not multiples of {FP8_DIM_MULTIPLE}); disable FP8."
        )
    return converted


def refresh_float8_weight_scales(model: nn.Module) -> bool:
    """Recompute the float8 scales FSDP2's float8 all-gather casts the weights with, from the current weights.

    torchao's ``precompute_float8_dynamic_scale_for_fsdp``: one stacked amax over every float8 all-gather
    weight, reduced once over all mesh axes (one small all-reduce per step instead of one per weight at each
    all-gather). Under TP it is also what keeps the weight scales equal to one process's: without it each
    weight's all-gather reduces its amax over the FSDP axis only, i.e. per TP shard. Call after every
    optimizer step and after the weights are initialized or restored (a stale scale can saturate the cast).

    Args:
        model: the model after FSDP2, with ``float8_all_gather`` conversions (tensorwise).

    Returns:
        True when some weight had a scale to refresh (False: no float8 all-gather weight, nothing done).
    """
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor, precompute_float8_dynamic_scale_for_fsdp

    if not any(
        isinstance(m, Float8Linear)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
        for m in model.modules()
    ):
        return False
    precompute_float8_dynamic_scale_for_fsdp(model)
    return True
