"""How logged metrics read on a console: short names, units and fixed formats for the progress bar and the
plain progress lines of a batch job (:class:`kempnerforge.callbacks.ProgressBar`)."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping


def _fixed(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:.{digits}f}"


def _general(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:.{digits}g}"


def _gib(v: float) -> str:
    return f"{v:.2f}GiB"


#: Logged metric name -> (console name, format). Names not listed are shown as logged, with 4 significant digits.
DISPLAY: dict[str, tuple[str, Callable[[float], str]]] = {
    "train/loss": ("loss", _fixed(4)),
    "train/lr": ("lr", lambda v: f"{v:.2e}"),
    "train/grad_norm": ("grad_norm", _general(3)),
    "train/tokens_per_s": ("tokens/s", lambda v: f"{v:,.0f}"),
    "train/tokens_per_s_per_device": ("tokens/s/device", lambda v: f"{v:,.0f}"),
    "train/mfu": ("MFU", lambda v: f"{100 * v:.1f}%"),
    "train/mfu_fp8": ("MFU_fp8", lambda v: f"{100 * v:.1f}%"),
    "train/moe_aux_loss": ("moe_aux_loss", _general(4)),
    "train/z_loss": ("z_loss", _general(4)),
    "memory/peak_gb": ("peak_mem", _gib),
    "memory/rss_gb": ("rss", _gib),
    "memory/allocated_gb": ("alloc_mem", _gib),
    "memory/reserved_gb": ("reserved_mem", _gib),
    "val/loss": ("val_loss", _fixed(4)),
    "val/ppl": ("val_ppl", _fixed(2)),
}


def format_metric(name: str, value: float) -> tuple[str, str]:
    """``(console name, formatted value)`` of one logged metric (:data:`DISPLAY`; others as logged, ``.4g``)."""
    label, fmt = DISPLAY.get(name, (name, _general(4)))
    return label, fmt(float(value))


def format_metrics(values: Mapping[str, float], order: Iterable[str] = ()) -> dict[str, str]:
    """Console names -> formatted values for ``values`` (logged name -> number): the names in ``order``
    first (those present), then the rest in their own order."""
    order = [n for n in order if n in values]
    names = order + [n for n in values if n not in order]
    return dict(format_metric(n, values[n]) for n in names)


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``1 day, H:MM:SS`` past a day) of a non-negative duration in seconds, rounded down."""
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


def eta_seconds(step: int, start_step: int, total: int | None, elapsed_s: float) -> float | None:
    """Seconds left at ``step`` of ``total`` optimizer steps, at the mean rate since this run started at
    ``start_step`` ``elapsed_s`` seconds ago (validation and checkpoint time included, as they recur);
    None without a known total or before the first step."""
    if total is None or step <= start_step:
        return None
    return max(0, total - step) * elapsed_s / (step - start_step)


def progress_line(step: int, total: int | None, metrics: Mapping[str, str], extra: Mapping[str, str] = ()) -> str:
    """One plain progress line: ``step 5/100 | loss 10.6021 | ... | elapsed 0:00:05 | ETA 0:01:35``.

    Args:
        step: optimizer steps done (``trainer.global_step``).
        total: the run's optimizer steps (None: unknown, shown as ``?``).
        metrics: console name -> formatted value (:func:`format_metrics`).
        extra: more ``name value`` fields at the end (elapsed, ETA).
    """
    total_text = "?" if total is None else str(total)
    fields = [f"step {step:>{len(total_text)}}/{total_text}"]
    fields += [f"{k} {v}" for k, v in {**metrics, **dict(extra)}.items()]
    return " | ".join(fields)
