"""The precision policy of ``KempnerStrategy``: one mechanism, FSDP2's ``MixedPrecisionPolicy``.

On CUDA the default is bf16 compute with fp32 master weights and fp32 gradient reduction (FSDP2
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, the setting of torchtitan and of
Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740, minus the loss scaling bf16 does not
need), and fp32 matmuls use TF32 (``torch.set_float32_matmul_precision("high")``). CPU keeps fp32.

Lightning's ``trainer.precision`` is mapped onto that policy here instead of adding a second
mechanism, value for value what Lightning's own ``ModelParallelStrategy`` accepts:

- ``32-true`` (the default) leaves the strategy's ``mixed_precision_param`` in charge;
- ``bf16-mixed`` means the same as ``mixed_precision_param=bfloat16`` (no ``torch.autocast`` on top of the sharded
  fp32 parameters);
- ``bf16-true`` / ``16-true``: the parameters themselves (so their gradients and optimizer states) are bf16 / fp16,
  as Lightning's ``HalfPrecision`` makes them. They are cast on the meta device before the chain
  (:func:`cast_parameters_`), so FSDP2 shards 16-bit storage and computes in it; buffers (RoPE tables) stay fp32,
  floating inputs are cast (:class:`TrueHalfInputs`), gradients are still reduced in ``mixed_precision_reduce``.
  No fp32 master copy exists: updates smaller than the 16-bit spacing are lost (bf16: 8 bits of mantissa), which is
  why the mixed policy is the default. No loss scaling for fp16 (as Lightning's ``16-true``).

Refused, each in one line: ``16-mixed`` (a sharded gradient scaler FSDP2 training here does not have), ``64-true``,
Transformer Engine (use ``float8_recipe``), and contradictions with ``mixed_precision_param``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

#: Values of the strategy's ``mixed_precision_param``; ``auto`` is bf16 on CUDA and fp32 elsewhere.
PARAM_DTYPE_CHOICES: tuple[str, ...] = ("auto", "bfloat16", "float32")

#: Values of the strategy's ``float32_matmul_precision`` (``torch.set_float32_matmul_precision``).
MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")

#: Lightning's legacy spellings of ``trainer.precision`` and the names they stand for.
_PRECISION_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}

_FIELD = "trainer.strategy.init_args.mixed_precision_param"

#: ``trainer.precision`` values whose parameters are stored in a 16-bit dtype.
TRUE_HALF: dict[str, torch.dtype] = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def true_half_dtype(precision: object) -> torch.dtype | None:
    """The parameter dtype of ``trainer.precision=precision`` (bf16 / fp16 for ``bf16-true`` / ``16-true``; None for
    every precision whose parameters stay fp32)."""
    return TRUE_HALF.get(_PRECISION_ALIASES.get(str(precision), str(precision)))


class TrueHalfInputs(Precision):
    """Lightning's plain precision plugin plus ``HalfPrecision``'s input cast: floating tensors of a batch (pixel
    values) become ``dtype`` before the step, as under Lightning's ``bf16-true`` / ``16-true``; integer tensors
    (token ids, labels) are untouched. The module itself is cast by :func:`cast_parameters_`, not by the plugin.

    Args:
        precision: ``"bf16-true"`` or ``"16-true"``.
    """

    def __init__(self, precision: str) -> None:
        self.precision = precision
        self.dtype = TRUE_HALF[precision]

    @override
    def convert_input(self, data: Any) -> Any:
        """``data`` with every floating tensor cast to :attr:`dtype`."""
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t)


def cast_parameters_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating parameter of ``model`` to ``dtype`` in place, keeping shared (tied) parameters shared and
    buffers as they are; meant for the meta device, before the parallel chain (nothing is allocated there)."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in done:
                done[id(param)] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            module._parameters[name] = done[id(param)]


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
        ``mixed_precision_param`` for ``32-true``, ``bf16-true`` and ``16-true`` (their dtype is
        :func:`true_half_dtype`'s); ``"bfloat16"`` for ``bf16-mixed``.

    Raises:
        ValueError: ``bf16-mixed`` with ``mixed_precision_param="float32"``, a true half precision with a
            ``mixed_precision_param`` other than ``auto`` (or ``bfloat16`` for ``bf16-true``), or any other
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
    if name in TRUE_HALF:
        allowed = ("auto", "bfloat16") if name == "bf16-true" else ("auto",)
        if mixed_precision_param not in allowed:
            raise ValueError(
                f"trainer.precision={name!r} contradicts {_FIELD}={mixed_precision_param!r}: {name} computes in the "
                f"parameters' own dtype ({TRUE_HALF[name]}); drop {_FIELD} or the precision."
            )
        return mixed_precision_param
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


_TRUE_NAME = {dtype: name for name, dtype in TRUE_HALF.items()}


def describe_precision(
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    matmul: str,
    device_type: str,
    true_half: torch.dtype | None = None,
) -> str:
    """One line for the start-up log, next to the mesh: compute, master-weight and reduction dtypes, matmuls
    (``true_half``: the parameters' own 16-bit dtype under ``bf16-true`` / ``16-true``)."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if true_half is not None:
        policy = (
            f"{short[true_half]} compute and weights, no fp32 master copy (trainer.precision={_TRUE_NAME[true_half]})"
        )
    elif param_dtype == torch.float32:
        policy = "fp32 compute and weights"
    else:
        policy = f"{short[param_dtype]} compute, fp32 master weights (FSDP2 MixedPrecisionPolicy)"
    kind = {"highest": "full fp32", "high": "TF32", "medium": "bf16"}[matmul]
    matmuls = f"fp32 matmuls in {kind} (float32_matmul_precision={matmul})" if device_type == "cuda" else ""
    parts = [policy, f"{short.get(reduce_dtype, str(reduce_dtype))} gradient reduction", matmuls]
    return "precision: " + ", ".join(p for p in parts if p)
