"""Where one of our parameters lies in a ``save_pretrained`` folder: the per-key form of the family mappings.

Each family module of :mod:`~kempnerforge.checkpoint.hf_families` (Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3) maps a canonical FQN of ours to an :class:`HFSource` with ``hf_source(fqn, cfg, disk_keys)``,
from the same name tables its state-dict converters use. A sharded load
(:func:`kempnerforge.checkpoint.hf_load.load_hf_weights_`) then reads, per parameter, only the elements this
rank stores (:meth:`kempnerforge.model.safetensors_shards.SafetensorsFolder.read_source_`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HFSource:
    """One of our tensors as a block of one HF tensor, or as a stack of HF tensors along our dim 0.

    - A rename: ``HFSource(("model.norm.weight",))``: same shape on both sides.
    - A block: ``offset`` gives, per dim of the HF tensor, where our tensor starts in it (Mixtral's fused
      ``gate_up_proj`` (E, 2 * hidden, dim) holds our ``w3`` (E, hidden, dim) at ``offset=(0, hidden, 0)``;
      a Qwen2-MoE shared expert ``s`` of width h is rows ``[s * h, (s + 1) * h)`` of ``shared_expert.gate_proj``).
    - A stack: ``stacked=True``, one key per index of our dim 0 (per-expert keys ``experts.{e}.w1.weight``
      (hidden, dim) for our packed ``w1`` (E, hidden, dim)); ``offset`` then applies to the remaining dims.
    - A row permutation of a rename or block: ``rows[i]`` is the block's dim-0 index of our row ``i`` (DeepSeek-V3's
      interleaved RoPE rows, reordered evens-then-odds inside each head's ``qk_rope_head_dim`` rows). A sharded read
      of our rows ``[a, b)`` reads the block rows ``[min(rows[a:b]), max(rows[a:b]) + 1)``: for a permutation inside
      groups of g rows, at most the shard plus 2 g rows.
    - A row permutation of several tensors concatenated along dim 0: ``concat=True``, ``rows[i]`` indexes
      ``cat([keys[0], keys[1], ...], 0)`` (a fused ``wqkv`` from ``q_proj``/``k_proj``/``v_proj``, a fused ``w13``
      from ``gate_proj``/``up_proj``: :mod:`kempnerforge.model.fused`). A sharded read takes, per key, the bounding
      range of the rows the shard needs from it (for whole KV groups / gate-up pairs: exactly those rows).

    Args:
        keys: HF tensor keys (one unless ``stacked``).
        offset: start of our block per HF dim (empty: all zeros).
        stacked: ``keys[e]`` is our ``[e]`` slice.
        rows: a permutation of ``range(block dim 0)`` (empty: identity); not with ``stacked``.
        concat: ``keys`` are concatenated along dim 0 (whole tensors, no ``offset``) and ``rows`` permutes the result.
    """

    keys: tuple[str, ...]
    offset: tuple[int, ...] = ()
    stacked: bool = False
    rows: tuple[int, ...] = ()
    concat: bool = False

    @property
    def key(self) -> str:
        """The HF key of a rename or block (the first key of a stack)."""
        return self.keys[0]


#: Our SwiGLU weight names -> HF's projection names (gate, up, down), for experts and shared experts alike.
SWIGLU_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def shared_expert_source(key_of: str, w: str, s: int, width: int) -> HFSource:
    """Our shared expert ``s`` (width ``width``) as a block of HF's single fused shared-expert MLP: rows
    ``[s * width, (s + 1) * width)`` of its gate/up projection, or those columns of its down projection.

    Args:
        key_of: the HF key with ``{}`` where the projection name goes (``...mlp.shared_expert.{}.weight``).
        w: ``"w1"``, ``"w2"`` or ``"w3"``.
    """
    return HFSource((key_of.format(SWIGLU_NAMES[w]),), offset=(0, s * width) if w == "w2" else (s * width, 0))


def routed_experts_source(prefix: str, w: str, num_experts: int, width: int, disk_keys: set[str]) -> HFSource:
    """Our packed routed experts' ``w1`` / ``w2`` / ``w3`` (E, ...) in a folder that holds them either per expert
    (``{prefix}.{e}.gate_proj.weight``, what transformers 5 ``save_pretrained`` writes for Qwen2/3-MoE and
    DeepSeek-V3) or packed (transformers 5's in-memory ``{prefix}.gate_up_proj`` (E, 2 * width, dim) and
    ``{prefix}.down_proj``).

    Args:
        prefix: the experts' HF module path (``model.layers.3.mlp.experts``).
        w: ``"w1"``, ``"w2"`` or ``"w3"``.
        width: one expert's hidden width (``w3`` starts at row ``width`` of ``gate_up_proj``).
        disk_keys: the folder's tensor keys.
    """
    name = SWIGLU_NAMES[w]
    if f"{prefix}.0.{name}.weight" in disk_keys:
        return HFSource(tuple(f"{prefix}.{e}.{name}.weight" for e in range(num_experts)), stacked=True)
    if w == "w2":
        return HFSource((f"{prefix}.down_proj",))
    return HFSource((f"{prefix}.gate_up_proj",), offset=(0, width if w == "w3" else 0, 0))


def gather_source(sd: Mapping[str, torch.Tensor], source: HFSource, shape: tuple[int, ...]) -> torch.Tensor:
    """Our whole tensor of global ``shape`` from an in-memory HF state dict ``sd``: what
    :meth:`~kempnerforge.model.safetensors_shards.SafetensorsFolder.read_source_` reads from a folder, shard by shard
    (a view for a rename or block, a copy for a stack).

    Raises:
        KeyError: a key of ``source`` is not in ``sd``.
    """
    if source.concat:
        return torch.cat([sd[key] for key in source.keys])[list(source.rows)]
    if source.stacked:
        offset = source.offset or (0,) * (len(shape) - 1)
        block = tuple(slice(o, o + n) for o, n in zip(offset, shape[1:], strict=True))
        return torch.stack([sd[key][block] for key in source.keys])
    offset = source.offset or (0,) * len(shape)
    block = sd[source.key][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    return block[list(source.rows)] if source.rows else block
