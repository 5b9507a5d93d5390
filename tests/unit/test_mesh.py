"""ParallelDims validation: every rule raises its exact message before anything is allocated."""

from __future__ import annotations

import pytest

from kempnerforge.parallel.mesh import MeshConfigError, ParallelDims


def test_dp_shard_inferred_from_world_size():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, world_size=8)
    assert dims.dp_shard == 4
    assert dims.dp == 8
    assert dims.shape == (1, 2, 4, 1, 1)


def test_product_must_equal_world_size_and_shows_the_math():
    with pytest.raises(
        MeshConfigError, match=r"pp\*dp_replicate\*dp_shard\*cp\*tp = 1\*2\*3\*1\*1 = 6, but world_size=4"
    ):
        ParallelDims(dp_replicate=2, dp_shard=3, world_size=4)


def test_dp_shard_cannot_be_inferred():
    with pytest.raises(
        MeshConfigError, match=r"dp_shard=-1 cannot be inferred: world_size=3 is not divisible by .* = 2"
    ):
        ParallelDims(dp_replicate=2, world_size=3)


@pytest.mark.parametrize("field", ["dp_replicate", "tp", "pp", "cp", "ep"])
def test_degrees_must_be_positive(field):
    with pytest.raises(MeshConfigError, match=rf"{field}=0 is not allowed: parallel degrees are integers >= 1"):
        ParallelDims(**{field: 0}, world_size=1)


def test_dp_shard_zero_refused():
    with pytest.raises(MeshConfigError, match=r"dp_shard=0 is not allowed: use an integer >= 1, or -1"):
        ParallelDims(dp_shard=0, world_size=1)


def test_cp_takes_its_ranks_from_the_world():
    dims = ParallelDims(cp=2, world_size=8)
    assert (dims.dp_shard, dims.dp, dims.shape) == (4, 4, (1, 1, 4, 2, 1))


def test_pp_takes_its_ranks_from_the_world():
    dims = ParallelDims(pp=2, world_size=4)
    assert (dims.dp_shard, dims.shape) == (2, (2, 1, 2, 1, 1))


def test_ep_must_divide_dp_shard_and_composes_with_dp_replicate():
    assert ParallelDims(ep=2, world_size=4).dp_shard == 4
    with pytest.raises(MeshConfigError, match=r"ep=3 must divide dp_shard=4.*allowed ep: \[1, 2, 4\]"):
        ParallelDims(ep=3, world_size=4)
    assert ParallelDims(ep=2, dp_replicate=2, world_size=4).shape == (1, 2, 2, 1, 1)  # EP + HSDP
    with pytest.raises(MeshConfigError, match=r"ep=4 must divide dp_shard=2.*allowed ep: \[1, 2\]"):
        ParallelDims(ep=4, dp_replicate=2, world_size=4)  # ep borrows from dp_shard only, never dp_replicate


def test_strategy_refuses_bad_degrees_at_construction():
    from kempnerforge.strategies import KempnerStrategy

    with pytest.raises(MeshConfigError, match="dp_replicate=0 is not allowed"):
        KempnerStrategy(dp_replicate=0)
    with pytest.raises(
        ValueError,
        match=r"mixed_precision_param='fp16' is not allowed; choose one of \['auto', 'bfloat16', 'float32'\]",
    ):
        KempnerStrategy(mixed_precision_param="fp16")
