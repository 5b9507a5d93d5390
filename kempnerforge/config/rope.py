"""RoPE context-extension settings (``ModelConfig.rope_scaling``), validated on construction.

Two published schemes, with the parameter names and meanings of ``transformers``' ``rope_parameters``:

- ``llama3``: Llama 3.1's frequency-dependent interpolation (Grattafiori et al., arXiv:2407.21783,
  section 3.3; Meta's ``apply_scaling``): wavelengths above ``original_max_position_embeddings /
  low_freq_factor`` are divided by ``factor``, those below ``.../ high_freq_factor`` are kept, and the
  band between is interpolated smoothly.
- ``yarn``: YaRN (Peng et al., arXiv:2309.00071): NTK-by-parts interpolation between ``beta_fast`` and
  ``beta_slow`` rotations, plus an attention factor on cos/sin (``0.1 * ln(factor) + 1``, or the
  DeepSeek-V3 ratio of ``mscale`` / ``mscale_all_dim``, or ``attention_factor`` as given).

The tables themselves are built by :func:`kempnerforge.model.rope.rope_tables`.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Allowed ``RopeScaling.rope_type`` values.
ROPE_TYPES = ("llama3", "yarn")


@dataclass
class RopeScaling:
    """RoPE scaling for contexts beyond the pretraining length (``llama3`` or ``yarn``).

    Fields a type does not use must stay at their defaults (so a config means one thing).

    Raises:
        ValueError: on construction, naming ``ModelConfig.rope_scaling.<field>`` and the allowed values:
            an unknown ``rope_type``, ``factor`` < 1, ``original_max_position_embeddings`` not a positive
            integer, llama3 ``high_freq_factor <= low_freq_factor``, non-positive yarn betas /
            mscales / attention factor, or a field set that the type does not use.
    """

    rope_type: str = "llama3"
    """'llama3' (Llama 3.1-3.3) or 'yarn' (Qwen long-context, DeepSeek-V3)."""
    factor: float = 8.0
    """Context extension factor (>= 1): low frequencies are divided by it."""
    original_max_position_embeddings: int = 8192
    """Context length of the pretraining the scaling extends, tokens."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotations bounding the extrapolated (unscaled) high-frequency channels."""
    beta_slow: float = 1.0
    """yarn: rotations bounding the fully interpolated low-frequency channels."""
    mscale: float | None = None
    """yarn: DeepSeek-V3 numerator of the attention factor (with mscale_all_dim); None = unused."""
    mscale_all_dim: float | None = None
    """yarn: DeepSeek-V3 denominator of the attention factor (with mscale); None = unused."""
    attention_factor: float | None = None
    """yarn: explicit multiplier on cos/sin; None = derived from factor (and mscale / mscale_all_dim)."""
    truncate: bool = True
    """yarn: round the correction range outward to whole channels (transformers' default; gpt-oss: False)."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"ModelConfig.rope_scaling.rope_type={self.rope_type!r}: allowed {list(ROPE_TYPES)}")
        _positive(self, "factor", minimum=1.0)
        omp = self.original_max_position_embeddings
        if isinstance(omp, bool) or not isinstance(omp, int) or omp <= 0:
            raise ValueError(
                f"ModelConfig.rope_scaling.original_max_position_embeddings={omp!r} must be a positive integer"
            )
        defaults = RopeScaling.__dataclass_fields__
        unused = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
        if self.rope_type == "yarn":
            unused = ("low_freq_factor", "high_freq_factor")
            for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, name) is not None:
                    _positive(self, name)
        else:
            _positive(self, "low_freq_factor")
            _positive(self, "high_freq_factor")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"ModelConfig.rope_scaling.high_freq_factor={self.high_freq_factor} must be > "
                    f"low_freq_factor={self.low_freq_factor} (llama3 interpolates between them)"
                )
        for name in unused:
            if getattr(self, name) != defaults[name].default:
                raise ValueError(
                    f"ModelConfig.rope_scaling.{name}={getattr(self, name)!r} is not used by rope_type="
                    f"{self.rope_type!r}; allowed: {defaults[name].default!r}"
                )


def _positive(scaling: RopeScaling, name: str, minimum: float | None = None) -> None:
    value = getattr(scaling, name)
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    ok = ok and (value >= minimum if minimum is not None else value > 0)
    if not ok:
        allowed = f"a number >= {minimum}" if minimum is not None else "a positive number"
        raise ValueError(f"ModelConfig.rope_scaling.{name}={value!r} must be {allowed}")


def rope_scaling_from_dict(value: RopeScaling | dict | None) -> RopeScaling | None:
    """``value`` as a :class:`RopeScaling` (a dict is what ``asdict`` / checkpoint metadata / YAML hold).

    Raises:
        ValueError: unknown keys (naming them) or any :class:`RopeScaling` refusal; a value of another type.
    """
    if value is None or isinstance(value, RopeScaling):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"ModelConfig.rope_scaling={value!r} must be None or a RopeScaling / dict of its fields")
    unknown = sorted(set(value) - set(RopeScaling.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"ModelConfig.rope_scaling has unknown fields {unknown}; allowed: {list(RopeScaling.__dataclass_fields__)}"
        )
    return RopeScaling(**value)
