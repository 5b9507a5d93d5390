"""The row layouts of the fused projections (``ModelConfig.fuse_qkv``: ``attention.wqkv``; ``ModelConfig.fuse_w13``:
``feed_forward.w13``) and the conversions between them and the separate ``wq``/``wk``/``wv``, ``w1``/``w3``.

Both layouts are chosen so that any contiguous block of whole groups of rows is a self-contained piece of the
unfused projections: column-wise tensor parallelism (``ColwiseParallel``, weight ``Shard(0)``) then hands every rank
whole KV groups / whole gate-up pairs, the layout is the same on every mesh, and the checkpoint does not depend on
``tp``. The grouped Q/K/V order follows torchtitan 0.3's ``FusedQKVLinear`` (rows ``(n_kv_heads, heads_per_kv + 2,
head_dim)``); litgpt's ``CausalSelfAttention.qkv`` used the same per-group order before it went to a plain
``[q; k; v]`` concatenation (which TP cannot shard without a custom style).

- ``wqkv`` (rows ``(n_heads + 2 * n_kv_heads) * head_dim``): KV group ``g`` (of ``n_kv_heads``) holds, in order,
  the ``heads_per_kv = n_heads / n_kv_heads`` query heads that share it (query heads ``g * heads_per_kv ..``, the
  order ``enable_gqa`` attention pairs them in), then key head ``g``, then value head ``g``; ``head_dim`` rows each.
  ``tp`` must divide ``n_kv_heads`` (already required by :func:`~kempnerforge.parallel.tensor_parallel.validate_tp`).
- ``w13`` (rows ``2 * hidden``): row ``2 * i`` is gate row ``i`` (``w1``), row ``2 * i + 1`` is up row ``i``
  (``w3``). ``tp`` must divide ``hidden`` (:func:`validate_fused_tp`).

Every mapping is one row permutation of the concatenation ``cat([wq, wk, wv])`` / ``cat([w1, w3])`` along dim 0
(:func:`qkv_rows`, :func:`w13_rows`), shared by the model's init (bit-identical to the unfused model for the same
seed), the HF converters and ``model.init_from``'s per-rank reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from kempnerforge.config.model import ModelConfig

#: Canonical FQNs of the fused parameters inside a decoder (``layers.{i}.`` prefix), with the unfused names they join.
FUSED_QKV = re.compile(r"^(.*\battention\.)wqkv\.(weight|bias)$")
FUSED_W13 = re.compile(r"^(.*\bfeed_forward\.)w13\.weight$")


def qkv_rows(n_heads: int, n_kv_heads: int, head_dim: int) -> list[int]:
    """Row ``r`` of the fused ``wqkv`` is row ``qkv_rows(...)[r]`` of ``cat([wq, wk, wv], 0)``.

    Args:
        n_heads: query heads; n_kv_heads: key/value heads (divides ``n_heads``); head_dim: channels per head.

    Returns:
        A permutation of ``range((n_heads + 2 * n_kv_heads) * head_dim)``.
    """
    hpk, n_q = n_heads // n_kv_heads, n_heads * head_dim
    k0, v0 = n_q, n_q + n_kv_heads * head_dim
    rows: list[int] = []
    for g in range(n_kv_heads):
        rows += range(g * hpk * head_dim, (g + 1) * hpk * head_dim)
        rows += range(k0 + g * head_dim, k0 + (g + 1) * head_dim)
        rows += range(v0 + g * head_dim, v0 + (g + 1) * head_dim)
    return rows


def w13_rows(hidden: int) -> list[int]:
    """Row ``r`` of the fused ``w13`` is row ``w13_rows(hidden)[r]`` of ``cat([w1, w3], 0)`` (gate/up interleaved)."""
    return [r // 2 + (r % 2) * hidden for r in range(2 * hidden)]


def config_qkv_rows(cfg: ModelConfig) -> list[int]:
    """:func:`qkv_rows` of ``cfg``'s attention."""
    return qkv_rows(cfg.n_heads, cfg.n_kv_heads_resolved, cfg.head_dim_resolved)


def fuse_rows(parts: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
    """``cat(parts, 0)[rows]`` (a copy): the fused weight or bias of the separate ones."""
    return torch.cat(parts, dim=0)[torch.tensor(rows)]


def split_rows(fused: torch.Tensor, rows: list[int], sizes: list[int]) -> list[torch.Tensor]:
    """The inverse of :func:`fuse_rows`: the separate tensors (dim-0 sizes ``sizes``) of a fused one (copies)."""
    flat = torch.empty_like(fused)
    flat[torch.tensor(rows)] = fused
    return list(flat.split(sizes, dim=0))


def unfused_names(fqn: str) -> tuple[list[str], str] | None:
    """The separate parameters a fused one joins, and which layout: ``attention.wqkv.weight`` ->
    ``(["attention.wq.weight", "attention.wk.weight", "attention.wv.weight"], "qkv")``, ``feed_forward.w13.weight`` ->
    ``([... w1.weight, ... w3.weight], "w13")``; None for any other FQN."""
    if m := FUSED_QKV.match(fqn):
        return [f"{m.group(1)}{w}.{m.group(2)}" for w in ("wq", "wk", "wv")], "qkv"
    if m := FUSED_W13.match(fqn):
        return [f"{m.group(1)}{w}.weight" for w in ("w1", "w3")], "w13"
    return None


def layout_rows(kind: str, cfg: ModelConfig, n_rows: int) -> list[int]:
    """The row permutation of layout ``kind`` ("qkv" or "w13") for a fused tensor of ``n_rows`` rows under ``cfg``."""
    return config_qkv_rows(cfg) if kind == "qkv" else w13_rows(n_rows // 2)


def part_sizes(kind: str, cfg: ModelConfig, n_rows: int) -> list[int]:
    """Dim-0 sizes of the separate tensors of layout ``kind``: ``[n_heads, n_kv, n_kv] * head_dim`` or ``[h, h]``."""
    if kind == "qkv":
        nkv = cfg.n_kv_heads_resolved * cfg.head_dim_resolved
        return [cfg.n_heads * cfg.head_dim_resolved, nkv, nkv]
    return [n_rows // 2, n_rows // 2]


def split_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``sd`` with every fused ``wqkv`` / ``w13`` entry replaced by the separate ``wq``/``wk``/``wv`` / ``w1``/``w3``
    (copies; every other tensor as it is, in order). A state dict without fused keys comes back unchanged."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        found = unfused_names(key)
        if found is None:
            out[key] = value
            continue
        names, kind = found
        n = value.shape[0]
        out.update(zip(names, split_rows(value, layout_rows(kind, cfg, n), part_sizes(kind, cfg, n)), strict=True))
    return out


def join_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_state_dict` for ``cfg``: with ``cfg.fuse_qkv`` (GQA attention) every complete
    ``wq``/``wk``/``wv`` triple becomes ``wqkv``, with ``cfg.fuse_w13`` every dense ``feed_forward.w1``/``w3`` pair
    becomes ``w13`` (MoE experts and shared experts keep their own layout). Other keys pass through."""
    out = dict(sd)
    for key in list(sd):
        fused = None
        if cfg.fuse_qkv and cfg.attention == "gqa" and (m := re.match(r"^(.*\battention\.)wq\.(weight|bias)$", key)):
            fused = f"{m.group(1)}wqkv.{m.group(2)}"
        elif cfg.fuse_w13 and (m := re.match(r"^(.*\bfeed_forward\.)w1\.weight$", key)):
            fused = f"{m.group(1)}w13.weight"
        if fused is None:
            continue
        names, kind = unfused_names(fused)
        if not all(n in out for n in names):
            continue
        parts = [out.pop(n) for n in names]
        out[fused] = fuse_rows(parts, layout_rows(kind, cfg, sum(p.shape[0] for p in parts)))
    return out


def validate_fused_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse a tensor-parallel degree the fused layouts cannot shard (whole gate/up pairs per rank).

    ``fuse_qkv`` needs ``tp | n_kv_heads``, which :func:`~kempnerforge.parallel.tensor_parallel.validate_tp` already
    requires of every GQA model.

    Raises:
        MeshConfigError: (a ValueError) ``cfg.fuse_w13`` and ``tp`` does not divide the SwiGLU width ``ffn_hidden``,
            naming the fields.
    """
    from kempnerforge.parallel.mesh import MeshConfigError

    if cfg.fuse_w13 and tp > 1 and cfg.ffn_hidden % tp:
        raise MeshConfigError(
            f"model.fuse_w13=True needs tp={tp} to divide the SwiGLU width ffn_hidden={cfg.ffn_hidden} (each rank "
            "holds whole gate/up row pairs); set model.ffn_hidden_dim to a multiple of tp or model.fuse_w13=False"
        )


def _fused_name(fqn: str) -> str | None:
    """The fused parameter a separate one belongs to (``attention.wk.bias`` -> ``attention.wqkv.bias``), or None."""
    if m := re.match(r"^(.*\battention\.)w[qkv]\.(weight|bias)$", fqn):
        return f"{m.group(1)}wqkv.{m.group(2)}"
    if m := re.match(r"^(.*\bfeed_forward\.)w[13]\.weight$", fqn):
        return f"{m.group(1)}w13.weight"
    return None


def match_layout(state: Mapping[str, torch.Tensor], needed: set[str], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``state`` (a dense decoder's state dict) re-laid out so that the keys in ``needed`` exist: separate
    ``wq``/``wk``/``wv`` / ``w1``/``w3`` split out of a fused entry, or a fused entry joined from separate ones
    (a VLM backbone's warm start from a text model of the other layout, e.g. MoT's own separate projections).
    Entries nothing needs any more are dropped; a sharded (DTensor) entry is gathered first. Keys no layout change
    can supply stay missing (the caller names them)."""
    from kempnerforge.parallel.dtensor import to_full

    out = dict(state)
    for key in sorted(k for k in needed if k not in out):
        found, fused = unfused_names(key), _fused_name(key)
        if found is not None and all(n in out for n in found[0]):
            names, kind = found
            parts = [to_full(out[n]) for n in names]
            out[key] = fuse_rows(parts, layout_rows(kind, cfg, sum(p.shape[0] for p in parts)))
            for n in names:
                if n not in needed:
                    out.pop(n)
        elif fused is not None and fused in out:
            names, kind = unfused_names(fused)
            full = to_full(out[fused])
            n = full.shape[0]
            out.update(zip(names, split_rows(full, layout_rows(kind, cfg, n), part_sizes(kind, cfg, n)), strict=True))
            if fused not in needed:
                out.pop(fused)
    return out
