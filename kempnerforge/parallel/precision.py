"""The precision policy of ``KempnerStrategy``: one mechanism, FSDP2's ``MixedPrecisionPolicy``.

On CUDA the default is bf16 compute with fp32 master weights and fp32 gradient reduction (FSDP2
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, the setting of torchtitan and of
Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740, minus the loss scaling bf16 does not
need), and fp32 matmuls use TF32 (``torch.set_float32_matmul_precision("high")``). CPU keeps fp32.

Lightning's ``trainer.precision`` is mapped onto that policy here instead of adding a second
mechanism: ``32-true`` (the default) leaves the strategy's ``mixed_precision_param`` in charge,
``bf16-mixed`` means the same as ``mixed_precision_param=bfloat16`` (no ``torch.autocast`` on top of
the sharded fp32 parameters), and every other value is refused, because each would either cast the
sharded fp32 master weights to a 16-bit type (``bf16-true``, ``16-true``) or needs machinery FSDP2
training here does not have (``16-mixed``: a sharded gradient scaler; ``64-true``; Transformer Engine:
use ``float8_recipe``).
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

#: Values of the strategy's ``mixed_precision_param``; ``auto`` is bf16 on CUDA and fp32 elsewhere.
PARAM_DTYPE_CHOICES: tuple[str, ...] = ("auto", "bfloat16", "float32")

#: Values of the strategy's ``float32_matmul_precision`` (``torch.set_float32_matmul_precision``).
MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")

#: Lightning's legacy spellings of ``trainer.precision`` and the names they stand for.
_PRECISION_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}

_FIELD = "trainer.strategy.init_args.mixed_precision_param"


def resolve_param_dtype(name: str, device_type: str) -> torch.dtype:
    """The FSDP2 compute dtype ``mixed_precision_param=name`` stands for on ``device_type``.

    Args:
        name: one of :data:`PARAM_DTYPE_CHOICES`.
        device_type: ``"cuda"``, ``"cpu"``, ...; ``auto`` is bf16 on ``cuda`` only.

    Raises:
        ValueError: ``name`` is not in :data:`PARAM_DTYPE_CHOICES`.
    """
    check_param_dtype_name(name)
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def check_param_dtype_name(name: str) -> None:
    """Raises ValueError naming ``mixed_precision_param`` unless ``name`` is in :data:`PARAM_DTYPE_CHOICES`."""
    if name not in PARAM_DTYPE_CHOICES:
        raise ValueError(f"mixed_precision_param={name!r} is not allowed; choose one of {list(PARAM_DTYPE_CHOICES)}.")


def check_matmul_precision(value: str) -> None:
    """Raises ValueError naming ``float32_matmul_precision`` unless ``value`` is in :data:`MATMUL_PRECISIONS`."""
    if value not in MATMUL_PRECISIONS:
        raise ValueError(
            f"float32_matmul_precision={value!r} is not allowed; choose one of {list(MATMUL_PRECISIONS)} "
            "('highest' keeps full fp32 matmuls, 'high' allows TF32)."
        )


def apply_matmul_precision(value: str, device_type: str) -> None:
    """``torch.set_float32_matmul_precision(value)`` on CUDA (TF32 tensor cores for fp32 matmuls with
    ``high``); a no-op elsewhere, so CPU runs keep exact fp32 matmuls (and CPU parity tests their oracle)."""
    if device_type == "cuda":
        torch.set_float32_matmul_precision(value)


def trainer_precision_to_param(precision: object, mixed_precision_param: str) -> str:
    """The ``mixed_precision_param`` to use under Lightning's ``trainer.precision=precision``.

    Args:
        precision: ``trainer.precision`` as given (``"32-true"``, ``"bf16-mixed"``, legacy ``32`` / ``"bf16"``, ...).
        mixed_precision_param: the strategy's setting (:data:`PARAM_DTYPE_CHOICES`).

    Returns:
        ``mixed_precision_param`` for ``32-true``; ``"bfloat16"`` for ``bf16-mixed``.

    Raises:
        ValueError: ``bf16-mixed`` with ``mixed_precision_param="float32"`` (contradictory), or any other
            precision (one line naming ``trainer.strategy.init_args.mixed_precision_param``).
    """
    name = _PRECISION_ALIASES.get(str(precision), str(precision))
    if name == "32-true":
        return mixed_precision_param
    if name == "bf16-mixed":
        if mixed_precision_param == "float32":
            raise ValueError(
                f"trainer.precision='bf16-mixed' contradicts {_FIELD}='float32': bf16-mixed means "
                f"{_FIELD}=bfloat16 here; drop one of the two."
            )
        return "bfloat16"
    raise ValueError(
        f"trainer.precision={name!r} is not supported by KempnerStrategy: keep trainer.precision=32-true and set "
        f"{_FIELD} (auto: bf16 compute with fp32 master weights and gradient reduction on CUDA, fp32 on CPU; "
        "bfloat16; float32); FP8 training is float8_recipe."
    )


def plugin_precision_to_param(plugin: Precision, mixed_precision_param: str) -> str:
    """:func:`trainer_precision_to_param` for the precision plugin Lightning built from ``trainer.precision``.

    Only Lightning's plain ``Precision`` (``32-true``) and ``MixedPrecision("bf16-mixed")`` map onto the
    policy; any other plugin (half, double, Transformer Engine, bitsandbytes, a custom one) is refused,
    since it would cast or wrap the sharded parameters itself.

    Raises:
        ValueError: as :func:`trainer_precision_to_param`.
    """
    if type(plugin) is Precision:
        return mixed_precision_param
    if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
        return trainer_precision_to_param("bf16-mixed", mixed_precision_param)
    name = getattr(plugin, "precision", None)
    if type(plugin).__module__.startswith("lightning.") and name not in (None, "32-true"):
        return trainer_precision_to_param(name, mixed_precision_param)  # raises, naming the precision
    raise ValueError(
        f"trainer.plugins: the precision plugin {type(plugin).__name__} is not supported by KempnerStrategy (it "
        f"would cast or wrap the sharded parameters); remove it and set {_FIELD} (auto, bfloat16, float32)."
    )


def describe_precision(param_dtype: torch.dtype, reduce_dtype: torch.dtype, matmul: str, device_type: str) -> str:
    """One line for the start-up log, next to the mesh: compute, master-weight and reduction dtypes, matmuls."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    if param_dtype == torch.float32:
        policy = "fp32 compute and weights"
    else:
        policy = f"{short[param_dtype]} compute, fp32 master weights (FSDP2 MixedPrecisionPolicy)"
    kind = {"highest": "full fp32", "high": "TF32", "medium": "bf16"}[matmul]
    matmuls = f"fp32 matmuls in {kind} (float32_matmul_precision={matmul})" if device_type == "cuda" else ""
    parts = [policy, f"{short.get(reduce_dtype, str(reduce_dtype))} gradient reduction", matmuls]
    return "precision: " + ", ".join(p for p in parts if p)
