"""The model contract KempnerStrategy checks (kempnerforge.parallel.contract): our models fulfil it; a model or
module that does not is refused with one error naming every missing member, before the chain runs."""

from __future__ import annotations

import pytest
from torch import nn

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.model.moe import MoE
from kempnerforge.module import CausalLM
from kempnerforge.parallel.contract import (
    DeclaresFSDPUnits,
    DeclaresTPPlan,
    ModelContractError,
    ParallelModel,
    ParallelModule,
    TiesWeights,
    ValidatesParallel,
    check_model_contract,
    check_module_contract,
    is_moe_layer,
)
from kempnerforge.strategies import KempnerStrategy

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16)


def test_our_decoder_and_module_fulfil_the_contract():
    import torch

    with torch.device("meta"):
        model = Transformer(TINY)
        moe_model = Transformer(ModelConfig(**{**TINY.__dict__, "num_experts": 4, "top_k": 2}))
    assert isinstance(model, ParallelModel) and isinstance(model, DeclaresTPPlan) and isinstance(model, TiesWeights)
    assert not isinstance(model, DeclaresFSDPUnits)
    check_model_contract(model, tp=2)
    module = CausalLM(config=TINY)
    assert isinstance(module, ParallelModule) and isinstance(module, ValidatesParallel)
    check_module_contract(module)
    moes = [m for m in moe_model.modules() if is_moe_layer(m)]
    assert moes and all(isinstance(m, MoE) for m in moes)
    assert not any(is_moe_layer(m) for m in model.modules())


def test_vlm_declares_its_extra_fsdp_units():
    import torch

    from kempnerforge.model.vlm.model import VisionLanguageModel
    from tests.vlm_tiny import tiny_connector, tiny_encoder, tiny_text, tiny_vlm

    with torch.device("meta"):
        vlm = VisionLanguageModel(tiny_text(), tiny_vlm("joint_decoder"), tiny_encoder(), tiny_connector())
    assert isinstance(vlm, DeclaresFSDPUnits) and isinstance(vlm, ParallelModel)
    check_model_contract(vlm, tp=2)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])


def test_a_model_missing_members_is_refused_naming_all_of_them():
    with pytest.raises(ModelContractError, match=r"cannot parallelize Linear: it lacks `layers`: .*; `init_weights`"):
        check_model_contract(nn.Linear(4, 4))
    with pytest.raises(ModelContractError, match=r"_Blocks: it lacks `init_weights`: .*; `tp_plan`: .*tp > 1"):
        check_model_contract(_Blocks(), tp=2)
    with pytest.raises(ModelContractError, match="`model` to be an nn.Module after configure_model, got NoneType"):
        check_model_contract(None)


def test_the_strategy_refuses_a_plain_lightning_module_before_any_process_group():
    import torch.distributed as dist
    from lightning.pytorch.demos.boring_classes import BoringModel

    strategy = KempnerStrategy()
    with pytest.raises(ModelContractError, match=r"BoringModel: it lacks `model`: .*; `init_seed`"):
        strategy.check_layout(1, BoringModel(), None)
    assert not dist.is_initialized()
