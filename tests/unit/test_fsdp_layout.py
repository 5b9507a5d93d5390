"""The FSDP2 unit layout and expert placements of apply_fsdp, on a fake process group in one process.

Which modules are units (and which share one), the mesh and placement of every parameter, and which
units keep their all-gathered weights after forward; the numbers (parity with one process) are in
tests/distributed/test_fsdp_units_parity.py and test_expert_parallel_parity.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from kempnerforge.config import ModelConfig
from kempnerforge.estimate.cluster import fake_world
from kempnerforge.model import Transformer
from kempnerforge.model.vlm.model import VisionLanguageModel
from kempnerforge.parallel.dtensor import shard_indices
from kempnerforge.parallel.expert_parallel import apply_ep
from kempnerforge.parallel.fsdp import apply_fsdp, expert_shard_dim
from kempnerforge.parallel.mesh import ParallelDims, ParallelMesh
from kempnerforge.parallel.pipeline_stage import DecoderStage
from tests.vlm_tiny import tiny_connector, tiny_encoder, tiny_text, tiny_vlm

DENSE = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, multiple_of=16)


@pytest.fixture
def world4():
    """Rank 0 of a fake 4-rank world: collectives return at once, so only shapes are real."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh(**degrees) -> ParallelMesh:
    return ParallelDims(**degrees, world_size=4).build_mesh("cpu")


def _units(model: torch.nn.Module) -> dict[str, list[str]]:
    """FSDP2 state id -> the module names it manages, as sorted name lists keyed by their first name."""
    states: dict[int, list[str]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, FSDPModule):
            states.setdefault(id(fully_shard.state(mod)), []).append(name or "<root>")
    return {names[0]: sorted(names) for names in states.values()}


def _meta(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def _placement(p: DTensor) -> tuple[tuple[str, ...], tuple]:
    return tuple(p.device_mesh.mesh_dim_names), tuple(p.placements)


def test_untied_decoder_units_and_what_stays_gathered_after_forward(world4):
    model = _meta(DENSE)
    apply_fsdp(model, _mesh(dp_shard=4).fsdp)
    assert _units(model) == {
        "<root>": ["<root>"],
        "tok_embeddings": ["tok_embeddings"],
        "layers.0": ["layers.0"],
        "layers.1": ["layers.1"],
        "norm": ["norm", "output"],  # one unit
    }
    for name, p in model.named_parameters():
        assert _placement(p) == (("dp_shard",), (Shard(0),)), name
    model.to_empty(device="cpu")
    model(torch.randint(0, 64, (2, 8)))
    # After forward: the head (and the last block) stay gathered for the backward that follows at once,
    # the embedding and earlier blocks are resharded (DTensor again); nothing stays in the root.
    gathered = {n for n, p in model.named_parameters() if not isinstance(p, DTensor)}
    assert {n.rsplit(".", 1)[0].split(".")[0] for n in gathered} == {"layers", "norm", "output"}
    assert all(n.startswith("layers.1.") for n in gathered if n.startswith("layers."))


def test_tied_decoder_keeps_embedding_norm_and_head_in_one_unit(world4):
    model = _meta(replace(DENSE, tie_embeddings=True))
    apply_fsdp(model, _mesh(dp_shard=4).fsdp)
    assert _units(model)["tok_embeddings"] == ["norm", "output", "tok_embeddings"]
    assert model.output.weight is model.tok_embeddings.weight
    assert len(_units(model)) == 4  # root, the tied group, 2 blocks


def test_pipeline_stages_shard_only_the_ends_they_hold(world4):
    model = _meta(replace(DENSE, n_layers=3))
    first, middle, last = (DecoderStage(model, range(i, i + 1), first=i == 0, last=i == 2) for i in range(3))
    mesh = _mesh(dp_shard=4).fsdp
    for stage in (first, middle, last):
        apply_fsdp(stage, mesh, reshard_after_forward=False)
    assert set(_units(first)) == {"<root>", "tok_embeddings", "layers.0"}
    assert set(_units(middle)) == {"<root>", "layers.1"}
    assert _units(last) == {"<root>": ["<root>"], "layers.2": ["layers.2"], "norm": ["norm", "output"]}


@pytest.mark.parametrize("tie", [False, True])
def test_vlm_units_declared_then_backbone_ends(world4, tie):
    with torch.device("meta"):
        model = VisionLanguageModel(tiny_text(tie=tie), tiny_vlm("joint_decoder"), tiny_encoder(), tiny_connector())
    apply_fsdp(model, _mesh(dp_shard=4).fsdp)
    units = _units(model)
    layers = {f"encoder.model.encoder.layers.{i}" for i in range(2)}
    assert {*layers, "encoder", "connector", "backbone.layers.0", "backbone.layers.1", "<root>"} <= set(units)
    ends = ["backbone.norm", "backbone.output", "backbone.tok_embeddings"]
    if tie:
        assert ends in units.values()
    else:
        assert units["backbone.tok_embeddings"] == ["backbone.tok_embeddings"]
        assert units["backbone.norm"] == ["backbone.norm", "backbone.output"]


def _moe(num_experts: int) -> ModelConfig:
    return replace(DENSE, num_experts=num_experts, top_k=1, n_shared_experts=1)


def _expert_weights(model: Transformer) -> dict[str, DTensor]:
    return {n: p for n, p in model.named_parameters() if ".experts.w" in n}


@pytest.mark.parametrize(
    ("num_experts", "fsdp_placement", "local_experts"),
    [(2, Shard(1), 1), (8, Shard(0), 2)],
    ids=["2-experts-dim1", "8-experts-dim0"],
)
def test_expert_weights_with_ep2_on_4_ranks(world4, num_experts, fsdp_placement, local_experts):
    """ep=2 x expert-FSDP 2: 2 experts give 1 per EP rank, split on dim 1 over the 2 FSDP ranks (dim 0 would
    leave one of them padding only); 8 experts give 4 per EP rank, 2 per FSDP rank on dim 0."""
    pm = _mesh(dp_shard=4, ep=2)
    model = _meta(_moe(num_experts))
    apply_ep(model, pm.ep)
    apply_fsdp(model, pm.fsdp, expert_mesh=pm.expert_fsdp)
    units = _units(model)
    assert {"layers.0", "layers.0.moe", "layers.0.moe.experts", "norm", "tok_embeddings"} <= set(units)
    for name, p in _expert_weights(model).items():
        mesh_names, placements = _placement(p)
        assert mesh_names == ("dp_shard_mod_ep", "ep"), name
        assert placements[0].dim == fsdp_placement.dim and placements[1] == Shard(0), (name, placements)
        rows = p.shape[1] // 2 if fsdp_placement.dim == 1 else p.shape[1]
        assert tuple(p.to_local().shape) == (local_experts, rows, p.shape[2]), name
        assert p.to_local().numel() * 4 == p.numel()  # a quarter of the global weight, no padding
    assert _placement(model.layers["0"].moe.router.gate.weight) == (("dp_shard",), (Shard(0),))


@pytest.mark.parametrize(("num_experts", "dim"), [(2, 1), (4, 0)])
def test_expert_weights_without_ep_shard_on_dim1_when_experts_are_fewer_than_ranks(world4, num_experts, dim):
    model = _meta(_moe(num_experts))
    apply_ep(model, None)
    apply_fsdp(model, _mesh(dp_shard=4).fsdp)
    assert "layers.0.moe" not in _units(model)  # experts stay in the block's unit without EP
    for name, p in _expert_weights(model).items():
        assert _placement(p) == (("dp_shard",), (Shard(dim),)), name
        assert p.to_local().numel() * 4 == p.numel(), name


def test_expert_weights_under_hsdp_shard_over_dp_shard_only(world4):
    model = _meta(_moe(1))
    apply_ep(model, None)
    mesh: DeviceMesh = _mesh(dp_replicate=2, dp_shard=2).fsdp
    apply_fsdp(model, mesh)
    for p in _expert_weights(model).values():
        assert tuple(p.placements)[1] == Shard(1) and p.to_local().numel() * 2 == p.numel()


def test_expert_shard_dim_prefers_dim0_then_the_first_even_dim(caplog):
    assert expert_shard_dim((8, 48, 32), 4) == 0
    assert expert_shard_dim((1, 48, 32), 2) == 1
    assert expert_shard_dim((4, 48, 32), 3) == 1  # dim 0 would give 2, 2, 0 experts
    assert expert_shard_dim((4, 10, 32), 3) == 0  # dims 1 and 2 do not divide by 3 either: padded dim 0
    assert "no dim divides by the FSDP degree 3" in caplog.text


@pytest.mark.parametrize(("num_experts", "fsdp_dim"), [(8, 0), (2, 1)], ids=["8-experts-dim0", "2-experts-dim1"])
def test_ep_with_hsdp_which_rank_holds_which_expert_shard(num_experts, fsdp_dim):
    """dp_replicate=2 x dp_shard=4 with ep=2 on a fake 8-rank world, every rank in turn: global rank
    ``g = 4r + 2s + e`` (replica r, expert-FSDP shard s, EP rank e) holds EP rank e's experts, FSDP shard s of them
    (on dim 0 with 4 local experts, on dim 1 with 1), the same as its replica ``g +- 4``; the weights are DTensors
    on (dp_replicate, dp_shard_mod_ep, ep), Replicate over dp_replicate; and the sharded init gives every rank its
    slice of the one-process init (the oracle: the unsharded model's weights indexed by the rank's indices)."""
    cfg = _moe(num_experts)
    with torch.device("meta"):
        full = Transformer(cfg)
    full.to_empty(device="cpu")
    full.init_weights(seed=5)
    want = _expert_weights(full)
    held, groups = {}, {}
    for g in range(8):
        with fake_world(8, g):  # clears DTensor's mesh-keyed caches between the simulated ranks
            pm = ParallelDims(dp_replicate=2, dp_shard=4, ep=2, world_size=8).build_mesh("cpu")
            groups[g] = (pm.ep.mesh.tolist(), pm.expert_fsdp.mesh.tolist())
            model = _meta(cfg)
            apply_ep(model, pm.ep)
            apply_fsdp(model, pm.fsdp, expert_mesh=pm.expert_fsdp)
            model.to_empty(device="cpu")
            model.init_weights(seed=5)
            for name, p in _expert_weights(model).items():
                names, placements = _placement(p)
                assert names == ("dp_replicate", "dp_shard_mod_ep", "ep"), name
                assert placements[0].is_replicate() and placements[1].dim == fsdp_dim and placements[2] == Shard(0)
                idx = shard_indices(p)
                assert torch.equal(p.to_local(), want[name][torch.meshgrid(*idx, indexing="ij")]), (g, name)
                held[g, name] = [i.tolist() for i in idx]
            assert _placement(model.layers["0"].moe.router.gate.weight)[0] == ("dp_replicate", "dp_shard")
    name = "layers.0.moe.experts.w1"
    hidden = want[name].shape[1]
    for g in range(8):
        r, s, e = g // 4, g // 2 % 2, g % 2
        assert groups[g] == ([4 * r + 2 * s, 4 * r + 2 * s + 1], [[e, 2 + e], [4 + e, 6 + e]]), g
        experts, rows, _ = held[g, name]
        if fsdp_dim == 0:  # 4 experts per EP rank, 2 per FSDP shard
            assert experts == [4 * e + 2 * s, 4 * e + 2 * s + 1] and rows == list(range(hidden)), g
        else:  # 1 expert per EP rank, its hidden rows split in 2
            assert experts == [e] and rows == list(range(s * hidden // 2, (s + 1) * hidden // 2)), g
        assert held[g, name] == held[(g + 4) % 8, name]  # the replica holds the same shard
