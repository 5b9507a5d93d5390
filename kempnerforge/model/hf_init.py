"""A ``transformers`` model's own initialization, as per-tensor rules our sharded generator can apply.

``transformers`` (>= 5) initializes every weight through the functions of ``transformers.initialization`` (``normal_``,
``trunc_normal_``, ``xavier_uniform_``, ``lecun_normal_``, ``copy_`` for buffers, ...), all of which bottom out in
the torch primitives kept in ``transformers.initialization.TORCH_INIT_FUNCTIONS``. :func:`hf_init_plan` builds the
model on the meta device and runs the same sequence its constructor runs (each torch module's own
``reset_parameters``, then ``PreTrainedModel.initialize_weights``) with those primitives replaced by recorders. The
last rule recorded for a tensor is the distribution ``transformers`` would have drawn it from. :func:`apply_rule_`
then draws it with :mod:`kempnerforge.model.init` (counter-based, per shard, on the tensor's device), so a random
tower keeps HF's init distribution per parameter type (not HF's samples) and no rank builds a full tensor.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn

from kempnerforge.model.init import copy_full_, normal_init_, uniform_init_


@dataclass(frozen=True)
class InitRule:
    """One tensor's init: ``kind`` is ``normal`` (mean, std, a, b: absolute truncation bounds, +-inf for none),
    ``uniform`` (low, high), ``constant`` (value), ``copy`` (value: the full tensor, e.g. ``position_ids``) or
    ``unsupported`` (name: a torch primitive with no counter-based twin, such as ``orthogonal_``)."""

    kind: str
    args: dict[str, Any] = field(default_factory=dict)


def _fans(t: torch.Tensor) -> tuple[int, int]:
    return nn.init._calculate_fan_in_and_fan_out(t)


def _xavier_std(t: torch.Tensor, gain: float) -> float:
    fan_in, fan_out = _fans(t)
    return gain * math.sqrt(2.0 / float(fan_in + fan_out))


def _kaiming_std(t: torch.Tensor, a: float, mode: str, nonlinearity: str) -> float:
    return nn.init.calculate_gain(nonlinearity, a) / math.sqrt(nn.init._calculate_correct_fan(t, mode))


def _normal(mean: float, std: float, a: float = -math.inf, b: float = math.inf) -> InitRule:
    return InitRule("normal", {"mean": float(mean), "std": float(std), "a": float(a), "b": float(b)})


def _uniform_sym(bound: float) -> InitRule:
    return InitRule("uniform", {"low": -bound, "high": bound})


#: torch primitive -> (its arguments, bound by name) -> the rule it draws from (the formulas of torch.nn.init).
_RULES: dict[str, Callable[[dict[str, Any]], InitRule]] = {
    "uniform_": lambda k: InitRule("uniform", {"low": float(k["a"]), "high": float(k["b"])}),
    "normal_": lambda k: _normal(k["mean"], k["std"]),
    "trunc_normal_": lambda k: _normal(k["mean"], k["std"], k["a"], k["b"]),
    "constant_": lambda k: InitRule("constant", {"value": float(k["val"])}),
    "ones_": lambda k: InitRule("constant", {"value": 1.0}),
    "zeros_": lambda k: InitRule("constant", {"value": 0.0}),
    "xavier_uniform_": lambda k: _uniform_sym(math.sqrt(3.0) * _xavier_std(k["tensor"], k["gain"])),
    "xavier_normal_": lambda k: _normal(0.0, _xavier_std(k["tensor"], k["gain"])),
    "kaiming_uniform_": lambda k: _uniform_sym(
        math.sqrt(3.0) * _kaiming_std(k["tensor"], k["a"], k["mode"], k["nonlinearity"])
    ),
    "kaiming_normal_": lambda k: _normal(0.0, _kaiming_std(k["tensor"], k["a"], k["mode"], k["nonlinearity"])),
}


def hf_init_plan(model_cls: type, config: Any) -> dict[str, InitRule]:
    """The init rule of every parameter and buffer of ``model_cls(config)``, by FQN, without allocating them.

    Args:
        model_cls: a ``transformers`` ``PreTrainedModel`` subclass (e.g. ``SiglipVisionModel``).
        config: its config.

    Returns:
        FQN (``named_parameters`` / ``named_buffers`` names) -> :class:`InitRule`.

    Raises:
        ImportError: ``transformers`` older than 5 (no ``transformers.initialization``).
        RuntimeError: the init writes part of a tensor (a view), or leaves a tensor without any rule (named).
    """
    from transformers import initialization as hf_init

    with torch.device("meta"):
        model = model_cls(config)
    names = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    plan: dict[str, InitRule] = {}

    def target(tensor: torch.Tensor) -> str:
        name = names.get(id(tensor))
        if name is None:
            base = names.get(id(tensor._base)) if tensor._base is not None else None
            raise RuntimeError(f"{model_cls.__name__}'s init writes part of {base or 'a tensor'}; not supported.")
        return name

    def recorder(prim: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def record(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            bound = signature.bind(tensor, *args, **kwargs)
            bound.apply_defaults()
            rule = _RULES.get(prim)
            plan[target(tensor)] = rule(bound.arguments) if rule else InitRule("unsupported", {"name": prim})
            return tensor

        return record

    def record_copy(tensor: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        plan[target(tensor)] = InitRule("copy", {"value": other.detach().to("cpu").clone()})
        return tensor

    prims = {name: recorder(name, fn) for name, fn in hf_init.TORCH_INIT_FUNCTIONS.items()}
    with ExitStack() as stack, torch.no_grad():
        stack.enter_context(mock.patch.dict(hf_init.TORCH_INIT_FUNCTIONS, prims))
        stack.enter_context(mock.patch.object(hf_init, "copy_", record_copy))
        stack.enter_context(hf_init.guard_torch_init_functions())  # torch's own module inits go through them too
        for module in model.modules():  # what each torch module's constructor ran, then HF's pass over them
            reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
            if callable(reset):
                reset()
        model.initialize_weights()
    missing = sorted(set(names.values()) - set(plan))
    if missing:
        raise RuntimeError(f"{model_cls.__name__}'s init sets no value for {missing}.")
    return plan


@torch.no_grad()
def apply_rule_(tensor: torch.Tensor, rule: InitRule, fqn: str, seed: int) -> None:
    """Set ``tensor`` (plain or DTensor: this rank's shard only) by ``rule``, random ones from (seed, ``fqn``).

    Raises:
        ValueError: an ``unsupported`` rule (names the primitive and the tensor); callers refuse those first.
    """
    args = rule.args
    if rule.kind == "normal" and args["std"] > 0:
        normal_init_(tensor, fqn, seed, args["std"], args["mean"], args["a"], args["b"])
    elif rule.kind == "normal":  # std 0: the mean itself
        tensor.fill_(args["mean"])
    elif rule.kind == "uniform":
        uniform_init_(tensor, fqn, seed, args["low"], args["high"])
    elif rule.kind == "constant":
        tensor.fill_(args["value"])
    elif rule.kind == "copy":
        copy_full_(tensor, args["value"].to(tensor.dtype))
    else:
        raise ValueError(
            f"{fqn}: transformers initializes it with torch.nn.init.{args.get('name')}, which has no sharded "
            "counter-based version here; load it from a pretrained folder instead."
        )
