"""Tensor-parallel plan, order and validation (one process; a 1-rank gloo group for DeviceMesh)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.model.tp_plan import TPPlan
from kempnerforge.parallel.mesh import MeshConfigError, ParallelDims
from kempnerforge.parallel.order import TransformOrderError, applied_steps
from kempnerforge.parallel.tensor_parallel import apply_tp, unmatched_plan_entries, validate_tp


def _config(**kw) -> ModelConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, multiple_of=16)
    return ModelConfig(**{**base, **kw})


def _meta_model(**kw) -> Transformer:
    with torch.device("meta"):
        return Transformer(_config(**kw))


@pytest.fixture
def tp_mesh(gloo_world_1):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))


# -- the declared plan ----------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused-default", "unfused"])
def test_plan_covers_every_linear_and_matches_the_model(fused):
    model = _meta_model(qk_norm=True, fuse_qkv=fused, fuse_w13=fused)
    plan = model.tp_plan(sequence_parallel=True, loss_parallel=True)
    assert set(plan.root) == {"tok_embeddings", "norm", "output"}
    projections = (
        {"attention.wqkv", "feed_forward.w13"}
        if fused
        else {"attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"}
    )
    assert set(plan.block) == projections | {
        "attention.wo",
        "feed_forward.w2",
        "attention_norm",
        "ffn_norm",
        "attention",
        "feed_forward",
        "attention.q_norm",
        "attention.k_norm",
    }
    assert unmatched_plan_entries(model, plan.root) == []
    assert unmatched_plan_entries(model.layers["0"], plan.block) == []
    # every Linear of a block is sharded: nothing silently stays replicated
    linears = {n for n, m in model.layers["0"].named_modules() if isinstance(m, nn.Linear)}
    assert linears <= set(plan.block)
    assert isinstance(plan.block["attention.q_norm"], SequenceParallel)  # per-head norm: grads summed over TP


def test_plan_without_sequence_parallel_leaves_norms_alone_and_loss_parallel_keeps_logits_sharded():
    plan = _meta_model().tp_plan(sequence_parallel=False, loss_parallel=True)
    assert "norm" not in plan.root and "attention_norm" not in plan.block and "attention" not in plan.block
    out = plan.root["output"]
    assert isinstance(out, ColwiseParallel) and out.use_local_output is False
    assert _meta_model().tp_plan(sequence_parallel=False, loss_parallel=False).root["output"].use_local_output


# -- apply_tp ------------------------------------------------------------------------------------


def test_apply_tp_shards_every_planned_weight_and_keeps_tied_weights_tied(tp_mesh):
    model = _meta_model(tie_embeddings=True)
    apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=True)
    assert applied_steps(model) == ["tp"]
    assert model.output.weight is model.tok_embeddings.weight
    for name in ("tok_embeddings.weight", "layers.0.attention.wqkv.weight", "layers.1.feed_forward.w2.weight"):
        assert isinstance(model.get_parameter(name), DTensor), name
    assert not isinstance(model.norm.weight, DTensor)  # no sequence parallel: norms stay plain


MOE = dict(num_experts=4, top_k=2, n_shared_experts=2, shared_expert_gate=True, moe_frequency=2)


def test_moe_block_plan_shards_attention_and_experts_and_leaves_the_router_replicated():
    model = _meta_model(**MOE)  # block 0 dense, block 1 MoE
    plan = model.tp_plan(sequence_parallel=True, loss_parallel=True)
    assert unmatched_plan_entries(model.layers["0"], plan.block) == []
    assert unmatched_plan_entries(model.layers["1"], plan.moe_block) == []
    assert not any(k.startswith("feed_forward") for k in plan.moe_block)
    moe_linears = {n for n, m in model.layers["1"].named_modules() if isinstance(m, nn.Linear)}
    # Every Linear but the router's gate and the shared-expert gate (replicated by design) is in the plan.
    assert moe_linears - set(plan.moe_block) == {"moe.router.gate", "moe.shared_gate"}
    assert "moe.experts" in plan.moe_block and "moe" in plan.moe_block
    assert _meta_model().tp_plan(sequence_parallel=False, loss_parallel=True).moe_block == {}  # dense model


def test_apply_tp_on_moe_shards_expert_hidden_channels_and_keeps_router_plain(tp_mesh):
    model = _meta_model(**MOE)
    apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=True)
    moe = model.layers["1"].moe
    assert [p.placements for p in (moe.experts.w1, moe.experts.w2, moe.experts.w3)] == [
        (Shard(1),),
        (Shard(2),),
        (Shard(1),),
    ]
    assert moe.experts.tp_mesh is tp_mesh
    assert isinstance(moe.shared_experts["1"].w2.weight, DTensor)
    assert not isinstance(moe.router.gate.weight, DTensor) and not isinstance(moe.shared_gate.weight, DTensor)
    assert isinstance(model.layers["0"].feed_forward.w13.weight, DTensor)  # the dense block keeps the dense plan


def test_moe_model_with_a_plan_lacking_moe_block_raises(tp_mesh):
    class DenseOnly(Transformer):
        def tp_plan(self, *, sequence_parallel=False, loss_parallel=True):
            plan = super().tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
            return TPPlan(root=plan.root, block=plan.block)

    with torch.device("meta"):
        model = DenseOnly(_config(**MOE))
    with pytest.raises(ValueError, match=r"'layers.1.feed_forward.w13'"):
        apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=True)


def test_plan_matching_nothing_raises_and_names_the_entries(tp_mesh):
    class Renamed(Transformer):
        def tp_plan(self, *, sequence_parallel=False, loss_parallel=True):
            plan = super().tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
            plan.block["attention.qkv_proj"] = plan.block.pop("attention.wqkv")
            plan.root["lm_head"] = plan.root.pop("output")
            return plan

    with torch.device("meta"):
        model = Renamed(_config())
    with pytest.raises(
        ValueError,
        match=r"Tensor-parallel plan entries matched no module: \['root:lm_head', "
        r"'layers.0.attention.qkv_proj', 'layers.1.attention.qkv_proj'\]",
    ):
        apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=True)


def test_plan_after_a_wrapper_matches_nothing_and_raises(tp_mesh):
    """A wrapper (here activation checkpointing applied by hand) hides the Linears from the plan."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _meta_model()
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block)
    with pytest.raises(
        ValueError, match=r"matched no module: \[.*'layers.0.attention.wqkv', .*'layers.1.feed_forward.w13'\]"
    ):
        apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=True)


def test_empty_plan_raises(tp_mesh):
    class NoPlan(Transformer):
        def tp_plan(self, **_):
            return TPPlan()

    with torch.device("meta"):
        model = NoPlan(_config())
    with pytest.raises(ValueError, match=r"NoPlan.tp_plan\(\) is empty"):
        apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=True)


def test_fsdp_before_tp_raises(tp_mesh):
    from torch.distributed.device_mesh import init_device_mesh

    from kempnerforge.parallel.fsdp import apply_fsdp

    model = _meta_model()
    apply_fsdp(model, init_device_mesh("cpu", (1,)))
    with pytest.raises(TransformOrderError, match="Cannot apply 'tp' after 'fsdp'"):
        apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=True)


def test_tp_twice_raises(tp_mesh):
    model = _meta_model()
    apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=True)
    with pytest.raises(TransformOrderError, match="'tp' was already applied"):
        apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=True)


# -- validation messages ---------------------------------------------------------------------------


def test_tp_degree_is_accepted_by_the_mesh():
    dims = ParallelDims(tp=2, world_size=4)
    assert (dims.dp_shard, dims.tp, dims.dp) == (2, 2, 2)
    assert dims.shape == (1, 1, 2, 1, 2)


def test_n_heads_must_be_divisible_by_tp():
    with pytest.raises(
        MeshConfigError,
        match=r"^tp=3 must divide n_heads=4: each tensor-parallel rank holds "
        r"n_heads / tp query heads\.$",
    ):
        validate_tp(3, n_heads=4, n_kv_heads=4)


def test_n_kv_heads_must_be_divisible_by_tp():
    with pytest.raises(
        MeshConfigError,
        match=r"^tp=4 must divide n_kv_heads=2: each tensor-parallel rank holds "
        r"n_kv_heads / tp key/value heads\.$",
    ):
        validate_tp(4, n_heads=8, n_kv_heads=2)


def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    with pytest.raises(
        MeshConfigError,
        match=r"^sequence_parallel=True needs seq_len divisible by tp: seq_len=33, "
        r"tp=2 \(each rank holds seq_len / tp positions",
    ):
        validate_tp(2, n_heads=4, n_kv_heads=2, sequence_parallel=True, seq_len=33)
    validate_tp(2, n_heads=4, n_kv_heads=2, sequence_parallel=True, seq_len=32)
    validate_tp(2, n_heads=4, n_kv_heads=2, sequence_parallel=False, seq_len=33)


def test_sequence_parallel_without_tp_is_refused_by_the_strategy():
    from kempnerforge.strategies import KempnerStrategy

    with pytest.raises(
        MeshConfigError,
        match=r"^sequence_parallel=True needs tp > 1 \(it shards activations over "
        r"the tensor-parallel ranks\); got tp=1\.",
    ):
        KempnerStrategy(sequence_parallel=True)
    strategy = KempnerStrategy(tp=2, sequence_parallel=True, loss_parallel=False)
    assert (strategy.sequence_parallel, strategy.loss_parallel) == (True, False)
    with pytest.raises(ValueError, match=r"loss_parallel='yes' is not allowed; use True or False\."):
        KempnerStrategy(tp=2, loss_parallel="yes")


def test_causal_lm_validates_heads_against_tp():
    from kempnerforge.module import CausalLM

    module = CausalLM(config=_config(n_heads=4, n_kv_heads=2))
    module.validate_parallel(ParallelDims(tp=2, world_size=2))
    with pytest.raises(MeshConfigError, match=r"^tp=4 must divide n_kv_heads=2"):
        module.validate_parallel(ParallelDims(tp=4, world_size=4))
