"""Context parallelism (``cp > 1``): every training sequence split over the ``cp`` mesh axis.

The layout is the load-balanced "zigzag" (head-tail) split of Megatron-LM and torchtitan: the sequence is cut
into ``2 x cp`` equal chunks and cp rank ``i`` keeps chunks ``i`` and ``2 x cp - 1 - i``, so under a causal mask
every rank attends over the same number of (query, key) pairs. Each token keeps its global position: RoPE rotates
it by that position, and the attention mask compares global positions, so a cp run computes the one-process
function exactly (up to summation order).

Attention over the whole sequence from a shard, ``cp_attention``:

- ``allgather`` (the default; the method Llama 3 was trained with, arXiv:2407.21783 sec. 3.3.2): every block
  all-gathers K and V over ``cp`` in the forward (their gradients are reduce-scattered in the backward, the
  functional collective's autograd) and attends the local queries to all keys under a mask built from the
  global positions and the packed documents' ids. Any mask, any device: the path the CPU tests prove.
- ``ring``: torch's ring attention (``torch.distributed.tensor.experimental.context_parallel`` over flash /
  cuDNN SDPA), CUDA only: torch 2.13 has no sharding rule for the CPU SDPA kernel, so it is refused on CPU,
  and with packed documents (its SDPA path takes no document mask).

The batch is split by :func:`shard_batch` (every cp rank of one data shard receives the same full batch, like
TP ranks); the strategy marks the attention modules with the cp mesh (:func:`apply_cp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._functional_collectives import all_gather_single
from torch.distributed.device_mesh import DeviceMesh

from kempnerforge.parallel.mesh import MeshConfigError

#: The ``cp_attention`` values; the first is the default.
CP_ATTENTION = ("allgather", "ring")


class ContextParallelError(MeshConfigError):
    """A ``cp`` setting that cannot run with this model, data or device."""


def validate_cp_attention(method: str) -> None:
    """Raises ContextParallelError: ``method`` is not one of :data:`CP_ATTENTION`."""
    if method not in CP_ATTENTION:
        raise ContextParallelError(f"cp_attention={method!r} is not allowed: use one of {', '.join(CP_ATTENTION)}.")


def validate_cp_run(cp: int, method: str, module, seq_len: int | None, backend: str | None, **sp) -> None:
    """Every cp rule that needs no process group (the strategy's ``check_layout``, before the rendezvous).

    Args:
        cp: the context-parallel degree; method: ``cp_attention``; module: the LightningModule (it must declare
        ``supports_context_parallel``); seq_len: the data's tokens per sequence (None: unknown); backend: the
        process-group backend the run will use; sp: ``tp`` and ``sequence_parallel`` for :func:`validate_cp_seq_len`.

    Raises:
        ContextParallelError: ``ring`` (not built: torch 2.13 has no CPU sharding rule for SDPA, and the CUDA path
            is not wired yet), a module without cp support, or a ``seq_len`` that does not split.
    """
    validate_cp_attention(method)
    if cp <= 1:
        return
    if method == "ring":
        why = (
            "torch 2.13 has no sharding rule for the CPU SDPA kernel (aten._scaled_dot_product_flash_attention_for_cpu)"
            if backend == "gloo"
            else "the ring path over CUDA SDPA is not wired into this build yet"
        )
        raise ContextParallelError(f"cp_attention='ring' cannot run here: {why}; use cp_attention=allgather.")
    reason = getattr(module, "supports_context_parallel", "it declares no context-parallel support")
    if reason is not True:
        raise ContextParallelError(f"cp={cp} is not supported by {type(module).__name__}: {reason}; use cp=1.")
    if seq_len is not None:
        validate_cp_seq_len(seq_len, cp, **sp)


def validate_cp_seq_len(seq_len: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """The sequence length must split into ``2 x cp`` equal chunks (and, with sequence parallelism, each rank's
    ``seq_len / cp`` tokens into ``tp`` equal parts).

    Raises:
        ContextParallelError: ``seq_len % (2 * cp) != 0``, or ``(seq_len / cp) % tp != 0`` with sequence parallel.
    """
    if cp <= 1:
        return
    if seq_len % (2 * cp):
        raise ContextParallelError(
            f"data.seq_len={seq_len} must be divisible by 2 x cp = {2 * cp}: context parallelism cuts every "
            f"sequence into 2 x cp equal chunks (load-balanced causal split)."
        )
    if sequence_parallel and (seq_len // cp) % tp:
        raise ContextParallelError(
            f"data.seq_len={seq_len}: each cp rank's {seq_len // cp} tokens must be divisible by tp={tp} "
            "for sequence parallelism; use a seq_len divisible by 2 x cp x tp."
        )


def zigzag_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions (seq_len / cp,) int64 of the tokens cp rank ``rank`` keeps: chunks ``rank`` and
    ``2 x cp - 1 - rank`` of ``2 x cp``, in that order.

    Raises:
        ContextParallelError: ``seq_len`` not divisible by ``2 * cp``, or ``rank`` outside ``[0, cp)``.
    """
    validate_cp_seq_len(seq_len, cp)
    if not 0 <= rank < cp:
        raise ContextParallelError(f"cp rank {rank} is outside [0, {cp}).")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([head, tail])


@dataclass
class ContextShard:
    """What one cp rank's forward needs beyond its tokens.

    Attributes:
        positions: (seq / cp,) int64, the global positions of this rank's tokens (RoPE, queries' side of the mask).
        key_positions: (seq,) int64, the global positions of the gathered keys, in all-gather order (cp rank 0's
            tokens first); the keys are attended in that order, never re-sorted.
        doc_ids: (batch, seq) int of the whole sequence (packed documents), or None: one document per row.
        seq_len: the whole sequence's length.
    """

    positions: torch.Tensor
    key_positions: torch.Tensor
    doc_ids: torch.Tensor | None
    seq_len: int

    def attention_mask(self, flex: bool | None = None, dtype: torch.dtype | None = None):
        """The mask of this rank's queries over all keys: query at global position p sees a key at q <= p of
        the same document. Dense (batch or 1, 1, seq / cp, seq) on CPU: bool, or with a floating ``dtype`` the
        additive form (0 / -inf) SDPA's CPU flash kernel takes as it is; a FlexAttention ``BlockMask`` with
        ``flex`` (None: on CUDA) that never materializes it.

        The model builds it once per forward in the compute dtype: given a bool mask, SDPA would make (and keep
        for the backward) its own float copy in every block."""
        qpos, kpos, docs = self.positions, self.key_positions, self.doc_ids
        # FlexAttention has a backward on CUDA only (as model.attention.flex_attention_supported says).
        if not (qpos.device.type == "cuda" if flex is None else flex):
            allowed = kpos[None, :] <= qpos[:, None]  # (local, seq)
            if docs is None:
                allowed = allowed[None, None]
            else:
                same = docs[:, qpos][:, :, None] == docs[:, kpos][:, None, :]  # (batch, local, seq)
                allowed = (allowed & same)[:, None]
            if dtype is None or dtype == torch.bool:
                return allowed
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        from torch.nn.attention.flex_attention import create_block_mask

        if docs is None:

            def mask_mod(b, h, q, kv):
                return kpos[kv] <= qpos[q]

            batch = 1
        else:
            qdoc, kdoc = docs[:, qpos], docs[:, kpos]

            def mask_mod(b, h, q, kv):
                return (kpos[kv] <= qpos[q]) & (qdoc[b, q] == kdoc[b, kv])

            batch = docs.shape[0]
        return create_block_mask(mask_mod, batch, None, qpos.numel(), kpos.numel(), device=qpos.device)


def cp_positions(seq_len: int, mesh: DeviceMesh, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's positions (seq / cp,) and every rank's in all-gather order (seq,) on the 1-D ``cp`` mesh."""
    cp, rank = mesh.size(), mesh.get_local_rank()
    keys = torch.cat([zigzag_positions(seq_len, cp, r, device) for r in range(cp)])
    return zigzag_positions(seq_len, cp, rank, device), keys


def shard_batch(batch: dict[str, torch.Tensor], mesh: DeviceMesh) -> dict:
    """This cp rank's part of a text batch: ``input_ids`` / ``labels`` (batch, seq) become (batch, seq / cp) at
    :func:`zigzag_positions`; ``doc_ids`` (batch, seq) moves whole into the ``"cp"`` entry
    (a :class:`ContextShard`), which the model's forward takes as ``cp=``. Other entries are kept as they are.

    Raises:
        ContextParallelError: the sequence length does not split into ``2 x cp`` chunks.
    """
    tokens = batch["input_ids"]
    seq = tokens.shape[1]
    positions, keys = cp_positions(seq, mesh, tokens.device)
    out = dict(batch)
    for name in ("input_ids", "labels"):
        if name in batch:
            out[name] = batch[name].index_select(1, positions)
    out["cp"] = ContextShard(positions, keys, out.pop("doc_ids", None), seq)
    return out


def gather_sequence(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """All-gather ``t`` (batch, heads, local, head_dim) over the cp mesh along the sequence: (batch, heads,
    cp x local, head_dim), cp rank 0's part first; the backward reduce-scatters (sums) the gradient."""
    # Gathered along dim 0 (the functional collective's contiguous case), then moved back: the sequence axis
    # first, so each rank's part is one contiguous block.
    seq_first = t.permute(2, 0, 1, 3).contiguous()
    gathered = all_gather_single(seq_first, gather_dim=0, group=mesh)
    return gathered.permute(1, 2, 0, 3)


def gather_kv(k: torch.Tensor, v: torch.Tensor, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (batch, kv_heads, local, head_dim) of every cp rank, in one all-gather when their shapes match
    (two otherwise: MLA's values are narrower than its keys)."""
    if k.shape == v.shape:
        both = gather_sequence(torch.cat([k, v], dim=1), mesh)
        return both.split(k.shape[1], dim=1)
    return gather_sequence(k, mesh), gather_sequence(v, mesh)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules whose keys and values :func:`apply_cp` gathers (those with a ``cp_mesh`` slot)."""
    return [m for m in model.modules() if hasattr(m, "cp_mesh")]


def apply_cp(model: nn.Module, mesh: DeviceMesh | None) -> None:
    """Mark every attention module of ``model`` to gather K/V over the 1-D ``cp`` mesh (None: cp = 1, no-op).

    Order: any time before compile (the mesh is a constant of the compiled block); it touches no parameter.

    Raises:
        ContextParallelError: ``mesh`` given but the model has no attention module that supports cp.
    """
    if mesh is None:
        return
    modules = attention_modules(model)
    if not modules:
        raise ContextParallelError(f"{type(model).__name__} has no attention module that supports cp > 1.")
    for m in modules:
        m.cp_mesh = mesh
