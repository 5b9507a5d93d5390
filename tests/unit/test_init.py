"""The counter-based sharded init (kempnerforge.model.init): bits against a scalar reference, the distributions
against their exact CDFs (truncated normal, normal, uniform), independence, chunk and placement invariance (any
DTensor layout on a simulated mesh against slices of the unsharded init), HF's encoder init rules against HF's own
init, and safetensors slice reads."""

from __future__ import annotations

import contextlib
import math
from statistics import NormalDist

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from kempnerforge.model import init as kinit
from kempnerforge.model.init import (
    counter_bits,
    normal_init_,
    param_seed,
    trunc_normal_init_,
    uniform_init_,
)
from kempnerforge.model.safetensors_shards import SafetensorsFolder
from kempnerforge.parallel.dtensor import index_runs, shard_indices

SQRT2 = math.sqrt(2.0)


def _trunc_cdf(x: torch.Tensor, mean: float, std: float, a: float, b: float) -> torch.Tensor:
    """Exact CDF of N(mean, std^2) truncated to [a, b] (float64)."""
    phi = lambda v: 0.5 * (1 + torch.erf((v - mean) / (std * SQRT2)))  # noqa: E731
    lo, hi = phi(torch.tensor(a, dtype=torch.float64)), phi(torch.tensor(b, dtype=torch.float64))
    return ((phi(x.double()) - lo) / (hi - lo)).clamp(0, 1)


def _ks(sample: torch.Tensor, cdf) -> float:
    """One-sample Kolmogorov-Smirnov statistic of ``sample`` against ``cdf``."""
    x = sample.reshape(-1).double().sort().values
    n = x.numel()
    f = cdf(x)
    up = torch.arange(1, n + 1, dtype=torch.float64) / n - f
    down = f - torch.arange(0, n, dtype=torch.float64) / n
    return max(up.max().item(), down.max().item())


def _ks_crit(n: int, alpha: float = 1e-6) -> float:
    return math.sqrt(-math.log(alpha / 2) / 2) / math.sqrt(n)


def test_bits_equal_the_scalar_definition_including_indices_past_2_32():
    key = param_seed(7, "layers.3.attention.wq.weight")
    index = torch.tensor([0, 1, 2, 12345, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**41 + 3])
    wide = kinit._bits_(index.clone(), key, torch.empty_like(index), torch.empty_like(index))
    assert wide.tolist() == [counter_bits(key, int(i)) for i in index]
    narrow = kinit._bits_(index[:6].clone(), key, torch.empty(6, dtype=torch.int64))
    assert narrow.tolist() == wide[:6].tolist()
    assert 0 <= wide.min().item() and wide.max().item() < 2**32


def test_values_equal_the_inverse_cdf_of_the_scalar_bits():
    """Oracle: Python's NormalDist.inv_cdf on the bits' uniform, rounded to fp32 (erfinv vs inv_cdf: <= 1 ulp)."""
    p = torch.empty(64, 96)
    std = 0.02
    trunc_normal_init_(p, "w", 5, std)
    key = param_seed(5, "w")
    nd = NormalDist(0.0, std)
    lo, hi = nd.cdf(-3 * std), nd.cdf(3 * std)
    for i in [0, 1, 95, 96, 1000, 64 * 96 - 1]:
        u = (counter_bits(key, i) + 0.5) / 2**32
        want = torch.tensor(nd.inv_cdf(lo + u * (hi - lo)), dtype=torch.float64).float()
        got = p.view(-1)[i]
        assert abs(got.item() - want.item()) <= 1.01 * torch.finfo(torch.float32).eps * abs(want.item()) + 1e-12, i


def test_trunc_normal_statistics():
    std, n = 0.02, 1 << 20
    w = torch.empty(1024, 1024)
    trunc_normal_init_(w, "layers.0.feed_forward.w1.weight", 0, std)
    x = w.double().reshape(-1)
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    mass = math.erf(3 / SQRT2)
    true_std = std * math.sqrt(1 - 2 * 3 * phi3 / mass)  # variance of N(0, 1) truncated at +-3
    assert abs(x.mean().item()) < 5 * true_std / math.sqrt(n)
    assert x.std().item() == pytest.approx(true_std, rel=5 * 0.6 / math.sqrt(n))  # SE of a sample std ~ 0.6/sqrt(n)
    assert x.abs().max().item() <= 3 * std * (1 + 1e-7)
    assert x.abs().max().item() > 2.99 * std  # the truncation is reached, not a narrower range
    p_tail = (math.erf(3 / SQRT2) - math.erf(2 / SQRT2)) / mass  # P(|z| > 2 | |z| <= 3)
    tail = (x.abs() > 2 * std).double().mean().item()
    assert tail == pytest.approx(p_tail, abs=5 * math.sqrt(p_tail / n))
    assert _ks(x, lambda v: _trunc_cdf(v, 0.0, std, -3 * std, 3 * std)) < _ks_crit(n)


@pytest.mark.parametrize(
    ("mean", "std", "a", "b"),
    [(0.0, 1.0, -math.inf, math.inf), (0.5, 2.0, -1.0, 4.0), (0.0, 1e-6, -math.inf, math.inf)],
    ids=["normal", "asymmetric-truncation", "tiny-std"],
)
def test_normal_statistics(mean, std, a, b):
    n = 1 << 18
    w = torch.empty(n)
    normal_init_(w, "b", 1, std, mean, a, b)
    assert w.min().item() >= a and w.max().item() <= b
    assert _ks(w, lambda v: _trunc_cdf(v, mean, std, a, b)) < _ks_crit(n)
    if math.isinf(a):
        assert abs(w.double().mean().item() - mean) < 5 * std / math.sqrt(n)
        assert w.double().std().item() == pytest.approx(std, rel=5 / math.sqrt(2 * n))


def test_uniform_statistics():
    n = 1 << 18
    w = torch.empty(512, 512)
    uniform_init_(w, "u", 2, -0.3, 0.5)
    assert w.min().item() >= -0.3 and w.max().item() <= 0.5
    assert _ks(w, lambda v: ((v - (-0.3)) / 0.8).clamp(0, 1)) < _ks_crit(n)


def test_elements_parameters_and_seeds_are_uncorrelated():
    rows, cols = 512, 512
    n = rows * cols
    bound = 5 / math.sqrt(n)

    def draw(fqn: str, seed: int) -> torch.Tensor:
        w = torch.empty(rows, cols)
        uniform_init_(w, fqn, seed, -1.0, 1.0)
        return w.double()

    def corr(x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.reshape(-1) - x.mean(), y.reshape(-1) - y.mean()
        return (x @ y / (x.norm() * y.norm())).item()

    w = draw("layers.0.attention.wq.weight", 0)
    assert abs(corr(w[:, :-1], w[:, 1:])) < bound  # neighbours in a row (consecutive global indices)
    assert abs(corr(w[:-1], w[1:])) < bound  # neighbours in a column
    assert abs(corr(w, draw("layers.0.attention.wk.weight", 0))) < bound
    assert abs(corr(w, draw("layers.0.attention.wq.weight", 1))) < bound
    assert abs(corr(w, draw("layers.1.attention.wq.weight", 0))) < bound


def test_values_do_not_depend_on_the_chunk_size(monkeypatch):
    ref = torch.empty(5, 6, 7)
    trunc_normal_init_(ref, "experts.w1", 3, 0.02)
    for chunk in (1, 7, 13, 42, 1000):
        monkeypatch.setattr(kinit, "CHUNK_ELEMENTS", chunk)
        w = torch.full((5, 6, 7), float("nan"))
        trunc_normal_init_(w, "experts.w1", 3, 0.02)
        assert torch.equal(w, ref), chunk


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="need std > 0"):
        normal_init_(torch.empty(3), "w", 0, std=0.0)
    with pytest.raises(ValueError, match="need std > 0 and a < b"):
        normal_init_(torch.empty(3), "w", 0, std=1.0, a=1.0, b=-1.0)
    with pytest.raises(ValueError, match="need low < high"):
        uniform_init_(torch.empty(3), "w", 0, 1.0, 1.0)


@contextlib.contextmanager
def _fake_rank(rank: int, world: int):
    """This process as ``rank`` of a simulated world (torch's fake process group: local slicing only)."""
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


#: (global shape, mesh shape, placements): FSDP2 uneven Shard(0) and empty shards, Shard(1) even and uneven, 2-D
#: meshes (FSDP x TP, two mesh dims on one tensor dim, FSDP2 x TP _StridedShard), 3-D expert weights with
#: EP Shard(0) + expert-FSDP Shard(1), and a replicated mesh dim.
LAYOUTS = [
    ((7, 5), (4,), [Shard(0)]),
    ((3, 5), (4,), [Shard(0)]),
    ((6, 8), (4,), [Shard(1)]),
    ((6, 7), (4,), [Shard(1)]),
    ((10, 12), (2, 2), [Shard(0), Shard(1)]),
    ((10, 12), (2, 2), [Shard(0), Shard(0)]),
    ((12, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((4, 6, 8), (2, 2), [Shard(1), Shard(0)]),
    ((4, 6, 8), (2, 2), [Replicate(), Shard(2)]),
    ((9,), (4,), [Shard(0)]),
]


def _empty_like_sharded(full: torch.Tensor, mesh, placements) -> tuple[DTensor, DTensor]:
    ref = distribute_tensor(full, mesh, placements, src_data_rank=None)
    local = torch.full_like(ref.to_local(), float("nan"))
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=ref.shape, stride=ref.stride())
    return dt, ref


def test_every_placement_generates_its_slice_of_the_unsharded_init():
    """Oracle: ``distribute_tensor`` of the unsharded init (DTensor's own slicing) on every rank of the mesh."""
    full = {}
    for shape, _, _ in LAYOUTS:
        full[shape] = torch.empty(shape)
        trunc_normal_init_(full[shape], "layers.0.moe.experts.w1", 11, 0.02)
    for rank in range(4):
        with _fake_rank(rank, 4):
            for shape, mesh_shape, placements in LAYOUTS:
                mesh = init_device_mesh("cpu", mesh_shape)
                dt, ref = _empty_like_sharded(full[shape], mesh, placements)
                trunc_normal_init_(dt, "layers.0.moe.experts.w1", 11, 0.02)
                assert torch.equal(dt.to_local(), ref.to_local()), (rank, shape, placements)
                # the index vectors address exactly the local elements
                idx = shard_indices(dt)
                assert torch.equal(full[shape][torch.meshgrid(*idx, indexing="ij")], ref.to_local())


def test_index_runs():
    assert index_runs(torch.tensor([4, 5, 6, 9, 10])) == [(0, 4, 3), (3, 9, 2)]
    assert index_runs(torch.tensor([0, 2])) == [(0, 0, 1), (1, 2, 1)]
    assert index_runs(torch.tensor([], dtype=torch.int64)) == []


def test_safetensors_reads_only_each_ranks_slices(tmp_path, monkeypatch):
    """Every rank's shard equals ``distribute_tensor`` of the file's tensor, the blocks read (each one's mapped pages
    dropped once copied) add up to the shard, and the file is opened once per folder."""
    from kempnerforge.model import safetensors_file

    reads: list[int] = []
    drop = safetensors_file.SafetensorsFile.drop
    monkeypatch.setattr(
        safetensors_file.SafetensorsFile, "drop", lambda self, v: (reads.append(v.numel()), drop(self, v))
    )
    opens: list[str] = []
    real_open = safetensors_file.os.open
    monkeypatch.setattr(safetensors_file.os, "open", lambda p, *a: (opens.append(str(p)), real_open(p, *a))[1])
    torch.manual_seed(0)
    tensors = {"a": torch.randn(10, 12), "e": torch.randn(4, 6, 8).to(torch.bfloat16), "s": torch.tensor(3.0)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layouts = [
        ("a", (4,), [Shard(0)]),
        ("a", (4,), [Shard(1)]),
        ("a", (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
        ("e", (2, 2), [Shard(0), Shard(1)]),
    ]
    for rank in range(4):
        with _fake_rank(rank, 4), SafetensorsFolder(tmp_path) as folder:
            for key, mesh_shape, placements in layouts:
                mesh = init_device_mesh("cpu", mesh_shape)
                dt, ref = _empty_like_sharded(tensors[key].float(), mesh, placements)
                reads.clear()
                folder.read_shard_(dt, key)
                assert torch.equal(dt.to_local(), ref.to_local()), (rank, key, placements)
                assert sum(reads) == dt.to_local().numel() < tensors[key].numel()
            scalar = torch.empty(())
            folder.read_shard_(scalar, "s")
            assert scalar.item() == 3.0
            with pytest.raises(ValueError, match=r"tensor 'a' has shape \(10, 12\), the model expects \(12, 10\)"):
                folder.read_shard_(torch.empty(12, 10), "a")
    assert opens == [str(tmp_path / "model.safetensors")] * 4  # one open per folder (one per rank), not per key


def test_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"has no .safetensors weights \(it holds \['pytorch_model.bin'\]\)"):
        SafetensorsFolder(tmp_path)


def _ks2(x: torch.Tensor, y: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    x, y = x.reshape(-1).double().sort().values, y.reshape(-1).double().sort().values
    grid = torch.cat([x, y])
    fx = torch.searchsorted(x, grid, right=True).double() / x.numel()
    fy = torch.searchsorted(y, grid, right=True).double() / y.numel()
    return (fx - fy).abs().max().item()


@pytest.mark.parametrize("family", ["siglip", "clip"])
def test_random_encoder_draws_each_tensor_from_hfs_init_distribution(family):
    """Oracle: transformers' own init of the same tower (its constructor under a seed). Constant tensors (norms,
    biases, position ids) are equal; every random one passes a two-sample KS test against HF's sample."""
    import transformers

    from kempnerforge.config.vision import VisionEncoderConfig
    from kempnerforge.model.vision import VisionEncoder

    cfg = VisionEncoderConfig(
        family=family, image_size=64, patch_size=8, hidden_size=128, n_layers=1, n_heads=2, intermediate_size=256
    )
    with torch.device("meta"):
        ours = VisionEncoder(cfg)
    ours.to_empty(device="cpu")
    ours.init_weights(seed=0)
    torch.manual_seed(0)
    hf = type(ours.model)(ours.model.config)
    want = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    got = {**dict(ours.model.named_parameters()), **dict(ours.model.named_buffers())}
    assert set(got) == set(want)
    assert isinstance(ours.model, transformers.PreTrainedModel)
    for name, w in want.items():
        g = got[name].detach()
        if w.unique().numel() == 1 or not w.is_floating_point():
            assert torch.equal(g, w.detach()), name
        else:
            n = w.numel()
            assert _ks2(g, w.detach()) < math.sqrt(-math.log(1e-6 / 2) / 2) * math.sqrt(2 / n), name


def test_low_precision_parameters_get_the_float64_value_rounded_once():
    w = torch.empty(64, 64, dtype=torch.bfloat16)
    trunc_normal_init_(w, "w", 0, 0.02)
    ref = torch.empty(64, 64, dtype=torch.float64)
    trunc_normal_init_(ref, "w", 0, 0.02)
    assert torch.equal(w, ref.to(torch.bfloat16))


def test_random_encoder_refuses_an_init_without_a_counter_based_version_before_writing(monkeypatch):
    """A transformers init primitive we cannot replay per shard (e.g. ``orthogonal_``) is refused, naming the
    tensor and the primitive, before any tensor of the tower is written."""
    from kempnerforge.config.vision import VisionEncoderConfig
    from kempnerforge.errors import UserError
    from kempnerforge.model import vision
    from kempnerforge.model.hf_init import InitRule, hf_init_plan

    cfg = VisionEncoderConfig(
        family="siglip", image_size=64, patch_size=8, hidden_size=128, n_layers=1, n_heads=2, intermediate_size=256
    )
    with torch.device("meta"):
        ours = vision.VisionEncoder(cfg)
    ours.to_empty(device="cpu")
    with torch.no_grad():
        for t in (*ours.model.parameters(), *ours.model.buffers()):
            t.fill_(7)
    real = hf_init_plan(type(ours.model), ours.model.config)
    victim = next(n for n in real if n.endswith("q_proj.weight"))
    plan = {**real, victim: InitRule("unsupported", {"name": "orthogonal_"})}
    monkeypatch.setattr(vision, "hf_init_plan", lambda *a: plan)
    with pytest.raises(UserError, match=r"orthogonal_.*pretrained folder") as err:
        ours.init_weights(seed=0)
    assert err.value.field == "model.encoder.pretrained_path" and victim in str(err.value)
    assert all(bool((t == 7).all()) for t in (*ours.model.parameters(), *ours.model.buffers()))
