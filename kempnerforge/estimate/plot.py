"""``kforge estimate --plot``: memory over the simulated step, one row of panels per role.

Left panel of a row: the role's :attr:`~kempnerforge.estimate.report.RoleEstimate.timeline` (tracked bytes at
every FSDP unit hook, phase mark and high point between them), stacked by :data:`GROUPS`, with the step's phases
(forward, backward, optimizer) shaded, the peak marked, and the GPU's memory and ``capacity - allowance`` (the
most the tracked bytes may reach and still fit: the role's allowance, :mod:`kempnerforge.estimate.allowance`) as
horizontal lines. Right panel: the module groups ranked by the most memory held while one of them ran
(:func:`~kempnerforge.estimate.report.module_peaks`), stacked the same way. Units: GB = 1e9 bytes, as the report.

A ``.png`` is drawn by matplotlib's Agg renderer; an ``.html`` page holds the same figure as inline SVG (text as
paths: no font, script or stylesheet is fetched), the text report, and the plotted numbers as a JSON block
(``<script type="application/json" id="kforge-estimate-plot">``). matplotlib is an optional dependency (the
``plot`` extra), imported inside :func:`draw` only.
"""

from __future__ import annotations

import html
import io
import json
import re
from pathlib import Path
from typing import Any

from kempnerforge.estimate.report import Estimate, RoleEstimate, describe_layout, format_text, gb, module_peaks

#: Plotted group -> the tracker categories it sums (:data:`kempnerforge.estimate.tracker.CATEGORY`), bottom first.
GROUPS: dict[str, tuple[str, ...]] = {
    "parameters (sharded + gathered)": ("params", "unsharded_params", "buffers"),
    "gradients": ("grads", "unsharded_grads"),
    "optimizer states": ("optimizer_states",),
    "activations (+ inputs)": ("activations", "inputs"),
    "temporaries": ("temporaries",),
    "communication buffers": ("all_gather_buffers", "reduce_scatter_buffers"),
}
#: A category no group names (a tracker type added later) is drawn, not dropped: the stack adds up to the total.
OTHER = "other"
#: Okabe & Ito's colour-blind-safe palette, one colour per group.
COLORS = {
    "parameters (sharded + gathered)": "#0072B2",
    "gradients": "#009E73",
    "optimizer states": "#CC79A7",
    "activations (+ inputs)": "#E69F00",
    "temporaries": "#F0E442",
    "communication buffers": "#56B4E9",
    OTHER: "#999999",
}
PHASE_SHADE = {"forward": "#ffffff", "backward": "#ececec", "optimizer": "#dde6f0"}
LINE = "#D55E00"
LABEL_BOX = {"fc": "white", "ec": "none", "alpha": 0.8, "pad": 1}
#: Module groups in the ranking panel.
TOP_MODULES = 15


def grouped(categories: dict[str, int]) -> dict[str, int]:
    """Bytes by tracker category -> bytes by plotted group (:data:`GROUPS`, then :data:`OTHER`); ``total`` ignored."""
    out = {g: sum(categories.get(c, 0) for c in cats) for g, cats in GROUPS.items()}
    known = {c for cats in GROUPS.values() for c in cats} | {"total"}
    out[OTHER] = sum(v for k, v in categories.items() if k not in known)
    return out


def series(role: RoleEstimate) -> dict[str, Any]:
    """What the panels of ``role`` draw, in bytes.

    Returns:
        ``{"labels": [event label], "phases": [phase], "stack": {group: [bytes per event]}, "total": [bytes],
        "modules": [[label, {group: bytes}], ...]}`` (events in step order; modules largest first).
    """
    stack = {g: [] for g in [*GROUPS, OTHER]}
    for event in role.timeline:
        for g, v in grouped(event["bytes"]).items():
            stack[g].append(v)
    modules = [[label, grouped(snap)] for label, snap in module_peaks(role.memory, TOP_MODULES)]
    return {
        "labels": [e["label"] for e in role.timeline],
        "phases": [e["phase"] for e in role.timeline],
        "stack": stack,
        "total": [e["total"] for e in role.timeline],
        "modules": modules,
    }


def allowance_of(est: Estimate, role: RoleEstimate) -> int:
    """The allowance of ``role`` under the estimate's model (bytes): what the verdict adds to its tracked peak."""
    from kempnerforge.estimate.allowance import Allowance

    return Allowance(**est.allowance).needed(role.peak_bytes, role.communicators) - role.peak_bytes


def _phase_runs(phases: list[str]) -> list[tuple[str, int, int]]:
    """Contiguous ``(phase, first, last)`` event index runs."""
    runs: list[tuple[str, int, int]] = []
    for i, p in enumerate(phases):
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1], i)
        else:
            runs.append((p, i, i))
    return runs


def _shade_phases(ax: Any, phases: list[str]) -> None:
    """Shade each run of one phase, dot its start, name it at the top (the optimizer's narrow run upright)."""
    n = len(phases)
    for phase, first, last in _phase_runs(phases):
        left, right = first - 0.5, last + 0.5
        ax.axvspan(left, right, color=PHASE_SHADE.get(phase, "#ffffff"), zorder=-2, lw=0)
        if first:
            ax.axvline(left, color="#555555", lw=0.6, ls=":", zorder=-1)
        wide = (right - left) / max(n, 1) > 0.06
        if wide or phase == "optimizer":
            ax.text(
                (left + right) / 2,
                0.985,
                phase,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=8,
                color="#333333",
                rotation=0 if wide else 90,
                bbox=LABEL_BOX,
            )


def _capacity_lines(ax: Any, peak: int, allowance: int, capacity: int) -> float:
    """The GPU's memory and ``capacity - allowance`` as lines when in range of the peak (else a note saying where
    they are); returns the top of the y axis (GB)."""
    budget = capacity - allowance
    if budget <= 4 * peak:
        ax.axhline(capacity / 1e9, color=LINE, lw=1.4, label=f"GPU memory {gb(capacity)}")
        label = f"GPU memory - allowance {gb(allowance)} = {gb(budget)}"
        ax.axhline(budget / 1e9, color=LINE, lw=1.2, ls="--", label=label)
        return max(capacity, peak) * 1.08 / 1e9
    # Below the phase labels, above the peak's label (the peak sits at 1/1.3 of the height).
    note = f"GPU memory {gb(capacity)} ({gb(budget)} after the allowance): far above this scale"
    ax.text(0.01, 0.91, note, transform=ax.transAxes, ha="left", va="top", fontsize=8, color=LINE, bbox=LABEL_BOX)
    return peak * 1.3 / 1e9


def _timeline_panel(ax: Any, role: RoleEstimate, data: dict[str, Any], capacity: int, allowance: int) -> None:
    n = len(data["labels"])
    groups = [g for g in data["stack"] if any(data["stack"][g]) or g != OTHER]
    stack = [[v / 1e9 for v in data["stack"][g]] for g in groups]
    ax.stackplot(range(n), *stack, labels=groups, colors=[COLORS[g] for g in groups], linewidth=0)
    _shade_phases(ax, data["phases"])
    peak = role.peak_bytes
    at = max(range(n), key=lambda i: data["total"][i]) if n else 0
    ax.plot([at], [peak / 1e9], marker="v", color="black", ms=6, ls="none")
    phase = data["phases"][at] if n else "-"
    ax.annotate(f"peak {gb(peak)} ({phase})", (at, peak / 1e9), xytext=(6, 4), textcoords="offset points", fontsize=8)
    ax.set_ylim(0, _capacity_lines(ax, peak, allowance, capacity))
    ax.set_xlim(-0.5, max(n - 0.5, 0.5))
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_xlabel("step progress (tracker events: FSDP unit hooks, phase marks, peaks between them)")
    ax.grid(axis="y", color="#cccccc", lw=0.5)
    ax.set_axisbelow(True)
    ax.set_title(
        f"rank {role.rank}, {role.role} \u2014 peak {gb(peak)} + allowance {gb(allowance)} = {gb(peak + allowance)} "
        f"of {gb(capacity)}",
        fontsize=10,
        loc="left",
    )


def _module_panel(ax: Any, data: dict[str, Any]) -> None:
    rows = data["modules"]
    labels = [label for label, _ in rows]
    y = list(range(len(rows)))
    left = [0.0] * len(rows)
    for g in [*GROUPS, OTHER]:
        widths = [parts[g] / 1e9 for _, parts in rows]
        if g == OTHER and not any(widths):
            continue
        ax.barh(y, widths, left=left, color=COLORS[g], height=0.7)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, total in enumerate(left):
        ax.text(total, i, f" {total:.2f}", va="center", fontsize=7)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_ylim(max(len(rows), 8) - 0.5, -0.5)  # largest on top; bars of one height whatever their number
    ax.set_xlim(0, max(left, default=1) * 1.22 or 1)
    ax.set_xlabel("memory while it ran (GB)")
    ax.set_title(f"modules by peak (top {min(len(rows), TOP_MODULES)})", fontsize=10, loc="left")
    ax.grid(axis="x", color="#cccccc", lw=0.5)
    ax.set_axisbelow(True)


def draw(est: Estimate, recipe: str | None = None) -> Any:
    """The figure (a ``matplotlib.figure.Figure``, no pyplot state): one row per role, timeline left, modules right.

    Args:
        est: a finished estimate (roles with timelines).
        recipe: the recipe's name for the title (e.g. ``configs/llama3_70b.yaml``), or None.

    Raises:
        ImportError: matplotlib is not installed (``kforge estimate --plot`` refuses that up front).
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = len(est.roles)
    fig = Figure(figsize=(15, 1.0 + 4.0 * rows), layout="constrained")
    axes = fig.subplots(rows, 2, width_ratios=(2.6, 1), squeeze=False)
    for role, (left, right) in zip(est.roles, axes, strict=True):
        data = series(role)
        _timeline_panel(left, role, data, est.gpu_memory_bytes, allowance_of(est, role))
        _module_panel(right, data)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for phase in ("backward", "optimizer"):  # the shading's key: an interleaved schedule labels few of its runs
        handles.append(Patch(fc=PHASE_SHADE[phase], ec="#555555", lw=0.5))
        labels.append(f"{phase} phase (shaded)")
    fig.legend(handles, labels, loc="outside lower center", ncols=5, fontsize=8, frameon=False)
    v = est.verdict
    verdict = f": {'fits' if v.fits else 'does not fit'}, needs {gb(v.needed_bytes)} ({v.worst_role})" if v else ""
    fig.suptitle(
        f"kforge estimate{f' of {recipe}' if recipe else ''} on {est.num_nodes} x {est.devices_per_node} GPUs "
        f"({describe_layout(est)}), {gb(est.gpu_memory_bytes)} each{verdict}",
        fontsize=12,
    )
    return fig


def _svg(fig: Any) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "kforge"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = re.sub(r"<\?xml[^>]*\?>\s*", "", text)
    text = re.sub(r"<!DOCTYPE[^>]*>\s*", "", text)
    return re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)  # RDF names, nothing to show


def page(est: Estimate, recipe: str | None = None) -> str:
    """A self-contained HTML page: the figure as inline SVG, the text report and the plotted numbers (JSON)."""
    fig = draw(est, recipe)
    data = {
        "gpu_memory_bytes": est.gpu_memory_bytes,
        "roles": [{"rank": r.rank, "role": r.role, "peak_bytes": r.peak_bytes, **series(r)} for r in est.roles],
    }
    blob = json.dumps(data).replace("</", "<\\/")
    title = html.escape(f"kforge estimate{f' of {recipe}' if recipe else ''}")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}</title>\n"
        "<style>body{font-family:sans-serif;margin:1em}svg{max-width:100%;height:auto}"
        "pre{font-size:12px;background:#f6f6f6;padding:.8em;overflow-x:auto}</style>\n</head>\n<body>\n"
        f"{_svg(fig)}\n<pre>{html.escape(format_text(est))}</pre>\n"
        f'<script type="application/json" id="kforge-estimate-plot">{blob}</script>\n</body>\n</html>\n'
    )


def write(est: Estimate, path: str, recipe: str | None = None) -> None:
    """Draw ``est`` to ``path``: a PNG for ``.png``, a self-contained page for ``.html`` (:func:`page`).

    Raises:
        ValueError: another suffix (the CLI refuses it before simulating).
        ImportError: matplotlib is not installed.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".html":
        Path(path).write_text(page(est, recipe), encoding="utf-8")
    elif suffix == ".png":
        draw(est, recipe).savefig(path, dpi=110)
    else:
        raise ValueError(f"--plot={path}: give a path ending in .png or .html")
