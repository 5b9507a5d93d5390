"""One registry of the Hugging Face model families kempnerforge converts, both ways.

A family is a module with the mapping functions (see :class:`HFFamily`). Two look-ups dispatch to it:

- :func:`family_for_hf_config`: a transformers config (``config.json``) -> family, by ``model_type``
  (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``mixtral``, ``qwen2_moe``; others plug in with
  :func:`register_family`).
- :func:`family_for_config`: our :class:`ModelConfig` -> the family to export it as: the highest-priority family
  whose ``claims(cfg)`` holds (the feature that sets the family apart: QK-norm -> Qwen 3, q/k/v biases -> Qwen 2,
  shared experts -> Qwen2-MoE, ...), after which its ``check_compatible(cfg)`` refuses, naming the field, whatever
  that architecture cannot hold. A weight is never dropped silently.

Adding a family (e.g. DeepSeek-V3): write a module with the functions :class:`HFFamily` lists and call
``register_family(HFFamily(module, claims=..., priority=...))`` here, below the built-in ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from kempnerforge.checkpoint import (
    hf_deepseek_v3,
    hf_llama,
    hf_mixtral,
    hf_qwen2,
    hf_qwen2_moe,
    hf_qwen3,
    hf_qwen3_moe,
)
from kempnerforge.config.model import ModelConfig

#: What a family module provides (each a module-level name).
FAMILY_API = (
    "ARCHITECTURE",  # the transformers class written into config.json, e.g. "Qwen3ForCausalLM"
    "MODEL_TYPE",  # transformers' config.model_type, e.g. "qwen3"
    "check_compatible",  # (cfg) -> None; ValueError naming the ModelConfig field the architecture cannot hold
    "from_hf_config",  # (transformers config) -> ModelConfig; ValueError naming the HF field it cannot represent
    "to_hf_config",  # (cfg) -> transformers config
    "from_hf_state_dict",  # (HF state dict as transformers 5 holds it in memory, cfg) -> our state dict
    "to_hf_state_dict",  # (our state dict, cfg) -> HF state dict
)
# Optional: ``hf_source(fqn, cfg, disk_keys)``, where one parameter lies in a save_pretrained folder (model.init_from's
# per-rank load reads only what each rank keeps; a family without it is refused there, kforge convert still works).
# With it, optionally: ``hf_source_options(hf_config) -> dict`` (extra hf_source arguments from config.json),
# ``HF_BUFFERS`` (canonical FQN suffixes of buffers read from the folder too) and ``check_hf_dir(dir, hf_config)``
# (ValueError: the folder holds weights the model would drop).


@dataclass(frozen=True)
class HFFamily:
    """One HF architecture and its mapping module.

    Attributes:
        module: a module providing every name in :data:`FAMILY_API`.
        claims: ``cfg -> bool``: this family is the export target for ``cfg`` (its distinguishing features only;
            the module's ``check_compatible`` then refuses the rest).
        priority: among the families that claim a config, the highest priority wins (a specific family above the
            generic Llama / Mixtral ones, which claim every dense / MoE config).

    Raises:
        TypeError: on construction, ``module`` lacks a name of :data:`FAMILY_API`.
    """

    module: ModuleType
    claims: Callable[[ModelConfig], bool]
    priority: int = 0

    def __post_init__(self) -> None:
        missing = [name for name in FAMILY_API if not hasattr(self.module, name)]
        if missing:
            raise TypeError(f"HF family module {self.module.__name__} lacks {missing}")

    @property
    def architecture(self) -> str:
        """The transformers class name, e.g. ``Qwen3ForCausalLM``."""
        return self.module.ARCHITECTURE

    @property
    def model_type(self) -> str:
        """transformers' ``config.model_type``, e.g. ``qwen3``."""
        return self.module.MODEL_TYPE


_FAMILIES: dict[str, HFFamily] = {}


def register_family(family: HFFamily) -> None:
    """Add ``family`` (or replace the one with the same ``model_type``)."""
    _FAMILIES[family.model_type] = family


def families() -> tuple[HFFamily, ...]:
    """Every registered family, highest priority first."""
    return tuple(sorted(_FAMILIES.values(), key=lambda f: -f.priority))


def family_for_hf_config(hf_config) -> HFFamily:
    """The family of a transformers config (``AutoConfig.from_pretrained(dir)``), by its ``model_type``.

    Raises:
        ValueError: an unregistered ``model_type``, listing the allowed ones.
    """
    kind = getattr(hf_config, "model_type", None)
    if kind not in _FAMILIES:
        raise ValueError(f"HF model_type={kind!r} is not supported; allowed: {', '.join(map(repr, sorted(_FAMILIES)))}")
    return _FAMILIES[kind]


def family_for_config(cfg: ModelConfig) -> HFFamily:
    """The family ``cfg`` exports as (see the module docstring), after its ``check_compatible``.

    Raises:
        ValueError: no family claims ``cfg``, or the claiming family's ``check_compatible`` refuses a field.
    """
    for family in families():
        if family.claims(cfg):
            family.module.check_compatible(cfg)
            return family
    raise ValueError(f"no HF family represents this ModelConfig; registered: {[f.architecture for f in families()]}")


def _dense(cfg: ModelConfig) -> bool:
    return cfg.num_experts == 0


register_family(HFFamily(hf_llama, claims=_dense))
register_family(HFFamily(hf_qwen2, claims=lambda c: _dense(c) and c.attention_bias and not c.qk_norm, priority=10))
register_family(HFFamily(hf_qwen3, claims=lambda c: _dense(c) and c.qk_norm, priority=10))
register_family(HFFamily(hf_mixtral, claims=lambda c: not _dense(c)))
register_family(HFFamily(hf_qwen2_moe, claims=lambda c: not _dense(c) and c.n_shared_experts > 0, priority=10))
register_family(HFFamily(hf_qwen3_moe, claims=lambda c: not _dense(c) and c.qk_norm and c.n_shared_experts == 0,
                         priority=10))  # fmt: skip
# Multi-head latent attention is DeepSeek-V3's alone: it claims every MLA config, dense or MoE, above all others.
register_family(HFFamily(hf_deepseek_v3, claims=lambda c: c.attention == "mla", priority=20))
