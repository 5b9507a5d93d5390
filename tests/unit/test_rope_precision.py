"""Issue 17 check 1 (RoPE): under a bf16 FSDP2 policy the RoPE tables reach attention in fp32, bit-equal to the
model's fp32 buffers, in the dense decoder, every VLM backbone and a pipeline stage.

FSDP2's ``MixedPrecisionPolicy`` casts every floating-point forward input of a unit to bf16; the tables cross
block boundaries as their int32 bits (:func:`kempnerforge.model.rope.pack_rope`). A one-rank gloo mesh with
``param_dtype=bf16`` is the real code path (``apply_fsdp`` wraps there: its policy is what casts).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from kempnerforge.model import Transformer
from kempnerforge.model.attention import Attention
from kempnerforge.model.rope import pack_rope, unpack_rope
from kempnerforge.model.vlm import ARCHS, build_backbone
from kempnerforge.model.vlm.mot import MoTAttention
from kempnerforge.parallel.fsdp import apply_fsdp
from kempnerforge.parallel.pipeline_stage import DecoderStage
from tests.vlm_tiny import tiny_text, tiny_vlm

SEQ = 12


def _capture_tables(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) as every self-attention module of ``model`` receives them (positional args 1 and 2)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for m in model.modules():
        if isinstance(m, Attention | MoTAttention):
            m.register_forward_pre_hook(lambda _m, args: seen.append((args[1], args[2])))
    return seen


def _assert_fp32_tables(seen, model: torch.nn.Module, n_blocks: int, seq: int) -> None:
    assert len(seen) == n_blocks
    for cos, sin in seen:
        assert cos.dtype == sin.dtype == torch.float32
        assert torch.equal(cos, model.rope_cos[:seq]) and torch.equal(sin, model.rope_sin[:seq])


@pytest.fixture
def mesh(gloo_world_1):
    return init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))


def test_dense_decoder_blocks_get_fp32_tables_under_bf16(mesh):
    model = Transformer(tiny_text())
    model.init_weights(0)
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16)
    assert isinstance(model.layers["0"], FSDPModule)
    seen = _capture_tables(model)
    logits = model(torch.randint(0, 128, (2, SEQ)))
    assert logits.dtype == torch.bfloat16  # the policy really computes in bf16
    _assert_fp32_tables(seen, model, 2, SEQ)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_vlm_backbone_gets_fp32_tables_under_bf16(mesh, arch):
    backbone = build_backbone(tiny_text(), tiny_vlm(arch))
    backbone.init_weights(0)
    apply_fsdp(backbone, mesh, param_dtype=torch.bfloat16)
    seen = _capture_tables(backbone)
    n_visual = 4
    visual = torch.randn(2, n_visual, 32)
    backbone(torch.randint(0, 128, (2, SEQ)), visual)
    positions = backbone.sequence_length(n_visual, SEQ)  # the joint sequence, or the text alone (cross-attention)
    _assert_fp32_tables(seen, backbone, 2, positions)


def test_pipeline_stage_blocks_get_fp32_tables_under_bf16(mesh):
    model = Transformer(tiny_text())
    model.init_weights(0)
    stage = DecoderStage(model, range(2), first=True, last=True)
    apply_fsdp(stage, mesh, param_dtype=torch.bfloat16)
    seen = _capture_tables(stage)
    stage(torch.randint(0, 128, (2, SEQ)))
    _assert_fp32_tables(seen, model, 2, SEQ)


def test_the_policy_would_cast_plain_fp32_tables(mesh):
    """The oracle of the tests above: handed to a bf16 unit as floats, the tables arrive rounded to bf16."""
    model = Transformer(tiny_text())
    block = model.layers["0"]
    fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    got = {}
    block.register_forward_pre_hook(lambda _m, args: got.update(cos=args[1]))
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    with pytest.raises(TypeError, match="packed RoPE tables"):  # fp32 tables where the packed tensor belongs
        block(torch.randn(2, SEQ, 32), cos)
    assert got["cos"].dtype == torch.bfloat16
    block(torch.randn(2, SEQ, 32), pack_rope(cos, sin))
    assert got["cos"].dtype == torch.int32 and torch.equal(unpack_rope(got["cos"])[0], cos)
