"""Sharded, on-device, sharding-invariant parameter initialization from a counter-based generator.

Every element of every parameter is a pure function of (seed, canonical parameter FQN, the element's flat index in
the *global* tensor): ``value = F(key(seed, fqn), i)``. Each rank computes only the elements it stores, on the
parameter's own device, from their global indices (:func:`kempnerforge.parallel.dtensor.shard_indices`), in chunks of
:func:`chunk_elements`. No rank ever builds a full parameter, per-rank init time and memory shrink with the mesh, and
the global tensor is the same on every mesh (FSDP2 ``Shard(0)`` with uneven padding, ``Shard(1)``, FSDP2 x TP
``_StridedShard``, EP ``Shard(0)`` + expert FSDP), with or without AC / compile wrappers (:func:`canonical_fqn`), in
any visiting order, whatever the global RNG holds.

The generator (a keyed counter hash, in the spirit of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011):

- key: BLAKE2b of ``f"{seed}:{canonical_fqn}"`` -> 63 bits (:func:`param_seed`) -> ``k0`` (low 32), ``k1`` (high 31).
- 32 random bits of element ``i`` (``lo = i mod 2**32``, ``hi = i // 2**32``):
  ``x = mix(mix(lo ^ k0) ^ k1 ^ mix(hi ^ k1))`` with ``mix`` = the ``lowbias32`` integer hash (C. Wellons,
  hash-prospector: xorshift 16, multiply 0x7feb352d, xorshift 15, multiply 0x846ca68b, xorshift 16).
  Every step runs on int64 lanes holding values in [0, 2**32); a multiplier >= 2**31 is applied as its negative
  representative ``m - 2**32``, so every product is below 2**63 in magnitude (no signed overflow anywhere) and
  ``& 0xFFFFFFFF`` gives the product mod 2**32; shifts only see non-negative values (logical == arithmetic).
  The integer part is therefore bitwise identical on CPU and CUDA.
- A uniform on (low, high) in float64: ``v = x * s + (low + s / 2)`` with ``s = (high - low) / 2**32`` (the midpoint
  of the x-th of 2**32 equal cells). Uniform U(low, high): ``v`` itself. Truncated normal N(mean, std**2) on [a, b]
  by inversion (as ``torch.nn.init.trunc_normal_``): ``low, high = erf(alpha / sqrt 2), erf(beta / sqrt 2)`` (alpha,
  beta: the bounds in std units), ``z = mean + std * sqrt(2) * erfinv(v)``, clamped to [a, b] against rounding; an
  untruncated normal is the same with (low, high) = (-1, 1) (the largest |z| 32 bits reach is 6.2 std).
  Then one rounding to the parameter's dtype.

Guaranteed: bitwise identical initial weights on every mesh, shard layout, chunk size and module visiting order on
one device type (the values depend only on the element's global index); the integer bits identical on every device.
Not guaranteed: CPU vs CUDA bitwise equality of the float values, because ``erfinv`` is a different float64
implementation on each (they agree to a few float64 ulp, so after the rounding to fp32 almost every element is
equal and the rest differ by 1 fp32 ulp). The values differ from ``torch.nn.init.trunc_normal_`` with a seeded
``torch.Generator`` (the previous implementation): same distribution, other samples.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from kempnerforge.parallel.dtensor import index_runs, local_part, shard_indices

#: Elements generated per step (None: by device, :func:`chunk_elements`); the working buffer is ~4 tensors of this
#: many int64 / float64.
CHUNK_ELEMENTS: int | None = None


def chunk_elements(device: torch.device) -> int:
    """Elements per generation step on ``device``: :data:`CHUNK_ELEMENTS` if set, else 2**20 on CPU (~40 MB of
    working memory; fewer, larger ops keep intra-op thread barriers rare) and 2**22 on accelerators (~160 MB; few
    kernel launches per parameter)."""
    if CHUNK_ELEMENTS is not None:
        return CHUNK_ELEMENTS
    return 1 << 20 if device.type == "cpu" else 1 << 22


# Wrapper modules insert these components into FQNs (activation checkpointing, torch.compile,
# FSDP1); dropping them keeps the seed of a parameter the same with or without the wrapper.
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})

_MASK32 = 0xFFFFFFFF
_LOWBIAS32 = (0x7FEB352D, 0x846CA68B)


def canonical_fqn(fqn: str) -> str:
    """``fqn`` without wrapper components, e.g. ``layers.0._checkpoint_wrapped_module.attention.wq.weight``
    -> ``layers.0.attention.wq.weight``."""
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_PARTS)


def param_seed(seed: int, fqn: str) -> int:
    """Deterministic 63-bit key of one parameter from the run seed and its canonical FQN.

    Uses BLAKE2b (stable across processes and Python versions, unlike ``hash``).
    """
    digest = hashlib.blake2b(f"{seed}:{canonical_fqn(fqn)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def mix32(x: int) -> int:
    """``lowbias32`` on a Python int in [0, 2**32) (the scalar twin of the tensor hash; reference for tests)."""
    for shift, mult in zip((16, 15), _LOWBIAS32, strict=True):
        x ^= x >> shift
        x = (x * mult) & _MASK32
    return x ^ (x >> 16)


def counter_bits(key: int, index: int) -> int:
    """The 32 random bits of global flat element ``index`` under ``key`` (:func:`param_seed`), as a Python int.

    The scalar definition of the generator (module docstring); the tensor path computes the same bits.
    """
    k0, k1 = key & _MASK32, key >> 32
    lo, hi = index & _MASK32, index >> 32
    return mix32(mix32(lo ^ k0) ^ k1 ^ mix32(hi ^ k1))


def _signed(m: int) -> int:
    return m - (1 << 32) if m >= 1 << 31 else m


_MULTS = tuple(_signed(m) for m in _LOWBIAS32)


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` in place on int64 ``x`` holding values in [0, 2**32); ``tmp`` is scratch of the same shape."""
    for shift, mult in zip((16, 15), _MULTS, strict=True):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))
        x.mul_(mult).bitwise_and_(_MASK32)  # |x * mult| < 2**63: exact, then mod 2**32
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def _bits_(index: torch.Tensor, key: int, tmp: torch.Tensor, hi: torch.Tensor | None = None) -> torch.Tensor:
    """32 random bits (int64 in [0, 2**32)) per global flat ``index`` (int64, >= 0), computed in place.

    ``tmp`` (and ``hi``, needed when some index is >= 2**32) are int64 scratch of ``index``'s shape.
    """
    k0, k1 = key & _MASK32, key >> 32  # ints, or int64 tensors of per-element keys (then ``hi`` is given)
    if hi is not None:  # the high word enters elementwise
        torch.bitwise_right_shift(index, 32, out=hi).bitwise_xor_(k1)
        _mix32_(hi, tmp)
        index.bitwise_and_(_MASK32)
    x = _mix32_(index.bitwise_xor_(k0), tmp)
    if hi is not None:
        x.bitwise_xor_(hi).bitwise_xor_(k1)
    else:
        x.bitwise_xor_(k1 ^ mix32(k1))  # hi == 0 everywhere: mix(0 ^ k1) is one constant
    return _mix32_(x, tmp)


def _chunks(param: torch.Tensor, chunk: int, out: torch.Tensor):
    """Write the global flat indices of this rank's elements of ``param`` (local row-major order) into ``out``
    (int64, >= ``chunk`` elements), one chunk at a time; yield ``(flat_local_start, n)`` after each.

    Every chunk reuses ``out`` (fresh multi-MB tensors per chunk would cost a page fault per 4 KB on CPU).
    """
    dims = shard_indices(param)
    shape = [len(i) for i in dims]
    total = math.prod(shape)
    if all(len(i) == n for i, n in zip(dims[1:], param.shape[1:], strict=True)) and (
        len(index_runs(dims[0])) <= 1 if param.ndim else True
    ):  # one contiguous global range (plain tensors, Shard(0) layouts): a plain arange
        first = int(dims[0][0]) * math.prod(param.shape[1:]) if param.ndim else 0
        for start in range(0, total, chunk):
            n = min(chunk, total - start)
            torch.arange(first + start, first + start + n, out=out[:n])
            yield start, n
        return
    strides = [math.prod(param.shape[d + 1 :]) for d in range(param.ndim)]
    offs = [i.to(torch.int64) * s for i, s in zip(dims, strides, strict=True)]
    # The trailing dims whose block fits in a chunk are laid out once; the leading ones are walked in groups of rows.
    k = param.ndim
    while k > 0 and math.prod(shape[k - 1 :]) <= chunk:
        k -= 1
    inner = torch.zeros((), dtype=torch.int64, device=out.device)
    for d in range(k, param.ndim):
        inner = inner.unsqueeze(-1) + offs[d]
    inner = inner.reshape(-1)
    n_inner, n_outer = inner.numel(), math.prod(shape[:k])
    rows = max(1, chunk // n_inner)
    for o0 in range(0, n_outer, rows):
        rest = torch.arange(o0, min(o0 + rows, n_outer), device=out.device)
        base = torch.zeros_like(rest)
        for d in reversed(range(k)):
            base += offs[d][rest % shape[d]]
            rest = rest // shape[d]
        n = base.numel() * n_inner
        torch.add(base.unsqueeze(-1), inner, out=out[:n].view(base.numel(), n_inner))
        yield o0 * n_inner, n


class _Concat:
    """Per-element (key, index) of a parameter that is a row permutation of several tensors concatenated along dim 0
    (a fused projection, :mod:`kempnerforge.model.fused`): each element gets the bits it has in its own tensor."""

    def __init__(self, param: torch.Tensor, seed: int, concat: tuple[tuple[str, int], ...], rows, device) -> None:
        sizes = [n for _, n in concat]
        if len(rows) != sum(sizes) or sum(sizes) != param.shape[0]:
            raise ValueError(f"init: rows {len(rows)} / parts {sizes} do not describe dim 0 of {tuple(param.shape)}")
        self.keys = torch.tensor([param_seed(seed, f) for f, _ in concat], dtype=torch.int64, device=device)
        self.ends = torch.tensor(sizes, dtype=torch.int64, device=device).cumsum(0)
        self.starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), self.ends[:-1]])
        self.rows = torch.tensor(list(rows), dtype=torch.int64, device=device)
        self.cols = math.prod(param.shape[1:])

    def remap_(self, index: torch.Tensor) -> torch.Tensor:
        """Turn global flat indices of the fused tensor into each part's own flat indices (in place); return the
        per-element keys."""
        row = torch.div(index, self.cols, rounding_mode="floor")
        src = self.rows[row]
        part = torch.searchsorted(self.ends, src, right=True)
        index.sub_(row * self.cols).add_((src - self.starts[part]) * self.cols)
        return self.keys[part]


@torch.no_grad()
def _fill_(
    param: torch.Tensor,
    fqn: str,
    seed: int,
    low: float,
    high: float,
    finish=None,
    concat: tuple[tuple[str, int], ...] = (),
    rows=(),
) -> None:
    """Write ``finish(v)`` into this rank's part of ``param``, ``v`` uniform in (low, high) in float64 from the
    counter-based bits (``v = x * s + (low + s / 2)``, ``s = (high - low) / 2**32``); ``finish`` maps float64 in
    place, or is None. With ``concat`` ((fqn, dim-0 size) per part) ``param`` is ``cat(parts, 0)[rows]`` and each
    element draws from its part's FQN and index (``fqn`` unused)."""
    local = local_part(param)
    if local.numel() == 0:
        return
    key = param_seed(seed, fqn)
    parts = _Concat(param, seed, concat, rows, local.device) if concat else None
    scale = (high - low) * 2.0**-32
    shift = low + 0.5 * scale
    scratch = None if local.is_contiguous() else torch.empty(local.shape, dtype=local.dtype, device=local.device)
    flat = (local if scratch is None else scratch).view(-1)
    chunk = min(chunk_elements(local.device), local.numel())
    index, tmp = (torch.empty(chunk, dtype=torch.int64, device=local.device) for _ in range(2))
    hi = torch.empty_like(index) if param.numel() > 1 << 32 or parts is not None else None
    values = torch.empty(chunk, dtype=torch.float64, device=local.device)
    for start, n in _chunks(param, chunk, index):
        k = key if parts is None else parts.remap_(index[:n])
        bits = _bits_(index[:n], k, tmp[:n], None if hi is None else hi[:n])
        v = values[:n].copy_(bits).mul_(scale).add_(shift)  # (an int64 * float op would compute in float32)
        flat[start : start + n].copy_(v if finish is None else finish(v))
    if scratch is not None:  # a non-contiguous local view (never FSDP2's): one shard-sized copy
        local.copy_(scratch)


def normal_init_(
    param: torch.Tensor,
    fqn: str,
    seed: int,
    std: float,
    mean: float = 0.0,
    a: float = -math.inf,
    b: float = math.inf,
    concat: tuple[tuple[str, int], ...] = (),
    rows=(),
) -> None:
    """Fill ``param`` (plain or DTensor: this rank's shard only) from N(mean, std**2) truncated to [a, b].

    ``a`` / ``b`` are absolute bounds as in ``torch.nn.init.trunc_normal_`` (infinite: untruncated; the largest
    |z| 32 bits reach is 6.2 std). The values depend only on (seed, canonical ``fqn``, global element index).
    A fused parameter passes ``concat`` (``(fqn, dim-0 size)`` of each separate tensor it joins) and ``rows`` (its
    row ``r`` is row ``rows[r]`` of their concatenation): every element then gets exactly the value it has in its
    own separate tensor (bit-identical to the unfused model).

    Raises:
        ValueError: ``std <= 0`` or ``a >= b``.
    """
    if not std > 0 or not a < b:
        raise ValueError(f"normal_init_({fqn}): need std > 0 and a < b, got std={std}, a={a}, b={b}")
    ta, tb = (math.erf((x - mean) / (std * math.sqrt(2))) for x in (a, b))
    lo, hi = (a if math.isfinite(a) else None), (b if math.isfinite(b) else None)

    def finish(t: torch.Tensor) -> torch.Tensor:
        z = t.erfinv_().mul_(std * math.sqrt(2))
        z = z.add_(mean) if mean else z
        return z if lo is None and hi is None else z.clamp_(lo, hi)  # rounding at the bounds

    _fill_(param, fqn, seed, ta, tb, finish, concat, rows)


def uniform_init_(param: torch.Tensor, fqn: str, seed: int, low: float, high: float) -> None:
    """Fill ``param`` (plain or DTensor: this rank's shard only) from U(low, high), from (seed, ``fqn``) only.

    Raises:
        ValueError: ``low >= high``.
    """
    if not low < high:
        raise ValueError(f"uniform_init_({fqn}): need low < high, got {low}, {high}")
    _fill_(param, fqn, seed, low, high)


def trunc_normal_init_(
    param: torch.Tensor, fqn: str, seed: int, std: float, concat: tuple[tuple[str, int], ...] = (), rows=()
) -> None:
    """Fill ``param`` from N(0, std**2) truncated at +-3 std, drawn from (seed, ``fqn``) only (the decoder's rule).

    Each rank generates only its own shard, on the parameter's device (:func:`normal_init_`, which also describes
    ``concat`` / ``rows`` for fused projections).
    """
    normal_init_(param, fqn, seed, std, a=-3 * std, b=3 * std, concat=concat, rows=rows)


@torch.no_grad()
def ones_init_(param: torch.Tensor) -> None:
    """Fill ``param`` (plain or DTensor) with ones; fill_ works on the local shard of a DTensor."""
    param.fill_(1.0)


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (global-shape) tensor the caller already holds into ``param``, in place.

    For what genuinely exists in full (a buffer, a conversion or warm start from a whole state dict); the init path
    generates shards instead (:func:`normal_init_`). If ``param`` is a DTensor (FSDP2 / TP sharded), only this
    rank's shard is copied: ``distribute_tensor(..., src_data_rank=None)`` slices ``full`` locally (no
    communication, uneven ``Shard(0)`` included) with the same chunking DTensor uses.

    Args:
        param: plain tensor or DTensor of global shape S (any dtype; ``full`` is cast).
        full: tensor of shape S, identical on every rank.

    Raises:
        ValueError: if the global shapes differ.
    """
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"copy_full_: full tensor shape {tuple(full.shape)} != param shape {tuple(param.shape)}")
    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)
