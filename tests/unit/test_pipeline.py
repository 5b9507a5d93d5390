"""Pipeline parallelism, single process: stage split, pruning, and every validation rule with its message."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kempnerforge.config import ModelConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.model import Transformer
from kempnerforge.module import CausalLM
from kempnerforge.parallel.mesh import MeshConfigError
from kempnerforge.parallel.pipeline import (
    SCHEDULES,
    is_vision_language,
    prune_to_stages,
    stage_ids,
    stage_layer_ranges,
    validate_microbatches,
    validate_pipeline_model,
    validate_pipeline_options,
)
from kempnerforge.parallel.pipeline_stage import DecoderStage
from kempnerforge.strategies import KempnerStrategy

TINY = ModelConfig(dim=32, n_layers=4, n_heads=4, vocab_size=64, max_seq_len=16, multiple_of=16)


def test_balanced_and_explicit_split():
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layer_ranges(6, 3, [1, 5]) == [range(0, 1), range(1, 5), range(5, 6)]


def test_stage_placement_looped_and_v():
    assert stage_ids(0, 2, 2, "interleaved_1f1b") == [0, 2]
    assert stage_ids(1, 2, 2, "interleaved_1f1b") == [1, 3]
    assert stage_ids(0, 2, 2, "zbv") == [0, 3]
    assert stage_ids(1, 2, 1, "1f1b") == [1]


def test_pruned_stages_keep_full_model_names_and_compose_to_the_full_forward():
    """Stages built from pruned copies, chained, give the unsplit model's logits; FQNs are unchanged."""
    torch.manual_seed(0)
    full = Transformer(TINY)
    full.init_weights(seed=3)
    ranges = stage_layer_ranges(4, 2, [1])
    parts = []
    for ids in ([0], [1]):
        part = Transformer(TINY)
        part.init_weights(seed=3)
        prune_to_stages(part, ranges, ids)
        parts.append(part)
    assert set(parts[0].state_dict()) == {"tok_embeddings.weight", *{k for k in full.state_dict() if ".0." in k}}
    keys = set(parts[0].state_dict()) | set(parts[1].state_dict())
    assert keys == set(full.state_dict()) and not set(parts[0].state_dict()) & set(parts[1].state_dict())
    tokens = torch.randint(0, 64, (2, 8))
    h = DecoderStage(parts[0], ranges[0], first=True, last=False)(tokens)
    logits = DecoderStage(parts[1], ranges[1], first=False, last=True)(h)
    torch.testing.assert_close(logits, full(tokens), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "pipedream"}, r"pp_schedule='pipedream' is not allowed; choose one of"),
        ({"virtual_stages": 0}, r"pp_virtual_stages=0 must be an integer >= 1"),
        ({"microbatches": 0}, r"pp_microbatches=0 must be an integer >= 1"),
        ({"pp": 1, "microbatches": 4}, r"only apply with pp > 1"),
        ({"schedule": "1f1b", "virtual_stages": 2}, r"runs one stage per rank: pp_virtual_stages must be 1, got 2"),
        ({"schedule": "zbv", "virtual_stages": 3}, r"'zbv' needs pp_virtual_stages=2, got 3"),
        ({"split_points": [2, 3]}, r"pp_split_points=\[2, 3\] must list 1 layer indices"),
        ({"schedule": "interleaved_1f1b", "virtual_stages": 2, "split_points": [3, 1, 2]}, "strictly increasing"),
    ],
)
def test_pipeline_option_rules(kwargs, message):
    args = {"pp": 2, "schedule": "1f1b", "microbatches": None, "virtual_stages": 1, "split_points": None, **kwargs}
    with pytest.raises(MeshConfigError, match=message):
        validate_pipeline_options(**args)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pp": 4, "virtual_stages": 2}, r"pp\*pp_virtual_stages = 4\*2 = 8 stages exceeds n_layers=4"),
        ({"pp": 8}, r"8 stages exceeds n_layers=4"),
        ({"split_points": [4]}, r"pp_split_points=\[4\] must be < n_layers=4"),
        ({"num_experts": 8, "ep": 2}, r"ep=2 with pp=2 is not supported: expert parallelism inside pipeline"),
        ({"tie_embeddings": True, "schedule": "zbv", "virtual_stages": 2}, r"'zbv' with tie_embeddings=true"),
        ({"tie_embeddings": True, "tp": 2}, r"tp=2 with pp=2 and tie_embeddings=true is not supported"),
        ({"vlm_arch": "mot"}, r"pp=2 with vlm.arch='mot': not supported with pp > 1 \(allowed: joint_decoder\)"),
        ({"vlm_arch": "cross_attention"}, r"vlm.arch='cross_attention': not supported with pp > 1"),
    ],
)
def test_pipeline_model_rules(overrides, message):
    args = {"pp": 2, "virtual_stages": 1, "split_points": None, "n_layers": 4, "num_experts": 0}
    args |= {"tie_embeddings": False, **overrides}
    pp, v, split = args.pop("pp"), args.pop("virtual_stages"), args.pop("split_points")
    with pytest.raises(MeshConfigError, match=message):
        validate_pipeline_model(pp, v, split, **args)


@pytest.mark.parametrize(
    ("micro_batch", "microbatches", "schedule", "message"),
    [
        (8, 3, "gpipe", r"pp_microbatches=3 must divide data.micro_batch_size=8; allowed: \[1, 2, 4, 8\]"),
        (8, 1, "1f1b", r"'1f1b' needs pp_microbatches >= pp=2, got 1"),
        (6, 3, "interleaved_1f1b", r"needs pp_microbatches to be a multiple of pp=2, got 3"),
    ],
)
def test_microbatch_rules(micro_batch, microbatches, schedule, message):
    with pytest.raises(MeshConfigError, match=message):
        validate_microbatches(micro_batch, microbatches, 2, schedule)


def test_every_schedule_name_is_a_torch_class():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"}


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_experts": 8},
        {"tie_embeddings": True},
        {"tie_embeddings": True, "schedule": "interleaved_1f1b"},
        {"vlm_arch": "joint_decoder", "tie_embeddings": True},
    ],
)
def test_pipeline_accepts_moe_and_tied_embeddings(overrides):
    """MoE (ep=1), tied embeddings and joint_decoder VLMs pipeline (proven against one process in
    test_pipeline_moe_tied.py and test_vlm_parity.py)."""
    args = {"n_layers": 4, "num_experts": 0, "tie_embeddings": False, **overrides}
    virtual = 2 if "schedule" in overrides else 1
    assert validate_pipeline_model(2, virtual, None, **args) is None
    # the neighbour that is still refused: EP inside stages for MoE, the V schedule for tied embeddings
    refused = {"ep": 2} if overrides.get("num_experts") else {"schedule": "zbv"}
    with pytest.raises(MeshConfigError):
        validate_pipeline_model(2, 2 if refused.get("schedule") else virtual, None, **{**args, **refused})


def test_tied_pruning_keeps_the_embedding_with_the_head_under_its_fqn():
    """Tied: the last stage keeps ``tok_embeddings`` (its weight is the head's), so its state holds the
    embedding's canonical key; chained stages still give the unsplit model's logits."""
    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    full = Transformer(cfg)
    full.init_weights(seed=3)
    ranges = stage_layer_ranges(4, 2)
    parts = []
    for ids in ([0], [1]):
        part = Transformer(cfg)
        part.init_weights(seed=3)
        prune_to_stages(part, ranges, ids)
        parts.append(part)
    assert parts[1].output.weight is parts[1].tok_embeddings.weight
    assert [n for n, _ in parts[1].named_parameters() if "tok_" in n or "output" in n] == ["tok_embeddings.weight"]
    torch.testing.assert_close(parts[1].tok_embeddings.weight, parts[0].tok_embeddings.weight, rtol=0, atol=0)
    last = DecoderStage(parts[1], ranges[1], first=False, last=True)
    assert last.tok_embeddings is parts[1].tok_embeddings  # one FSDP2 unit with the head
    tokens = torch.randint(0, 64, (2, 8))
    logits = last(DecoderStage(parts[0], ranges[0], first=True, last=False)(tokens))
    torch.testing.assert_close(logits, full(tokens), rtol=0, atol=0)


def test_aux_loss_to_backward_seeds_the_aux_gradient():
    """The identity on h whose backward adds ``scale * d aux`` equals backpropagating ``f(h) + scale * aux``."""
    from kempnerforge.parallel.pipeline_aux import AuxLossToBackward

    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3)
    scale = torch.tensor(2.5)

    def parts():
        h = x * w
        return h, (w**2).sum()

    h, aux = parts()
    (AuxLossToBackward.apply(h, aux, scale).sin().sum()).backward()
    got, w.grad = w.grad.clone(), None
    h, aux = parts()
    (h.sin().sum() + scale * aux).backward()
    torch.testing.assert_close(got, w.grad, rtol=0, atol=1e-6)


def test_vlm_detection():
    module = CausalLM(config=TINY)
    assert not is_vision_language(module)
    module.vlm = VLMConfig()
    assert is_vision_language(module)


def test_strategy_refuses_bad_pipeline_options_at_construction():
    with pytest.raises(MeshConfigError, match=r"pp_schedule='bogus' is not allowed"):
        KempnerStrategy(pp=2, pp_schedule="bogus")


@pytest.mark.parametrize(
    ("config", "strategy", "message"),
    [
        (
            dataclasses.replace(TINY, tie_embeddings=True),
            {"pp_schedule": "zbv", "pp_virtual_stages": 2},
            "tie_embeddings=true is not supported",
        ),
        (TINY, {"pp_microbatches": 3}, r"pp_microbatches=3 must divide data.micro_batch_size=4"),
    ],
)
def test_strategy_validates_the_model_and_data_before_allocating(config, strategy, message, tmp_path):
    """The rules ``setup_environment`` runs before the mesh or the model exist."""
    strat = KempnerStrategy(pp=2, **strategy)
    strat._lightning_module = CausalLM(config=config)
    data = TokenDataModule(data_dir=str(tmp_path), seq_len=8, micro_batch_size=4)
    with pytest.raises(MeshConfigError, match=message):
        strat.check_layout(2, strat._lightning_module, data)


def test_strategy_refuses_pp_with_expert_parallelism(tmp_path):
    strat = KempnerStrategy(pp=2, ep=2)
    strat._lightning_module = CausalLM(config=dataclasses.replace(TINY, num_experts=4))
    data = TokenDataModule(data_dir=str(tmp_path), seq_len=8, micro_batch_size=4)
    with pytest.raises(MeshConfigError, match=r"ep=2 with pp=2 is not supported"):
        strat.check_layout(4, strat._lightning_module, data)


@pytest.mark.parametrize(
    ("module_attr", "data_attr", "message"),
    [
        ({"loss_chunk_size": 16}, {}, r"model.loss_chunk_size=16 is not supported with pp=2"),
        ({"z_loss_weight": 1e-4}, {}, r"model.z_loss_weight=0.0001 is not supported with pp=2"),
        ({}, {"document_masking": True}, r"data.document_masking=True is not supported with pp=2"),
    ],
)
def test_strategy_refuses_loss_options_the_pipeline_does_not_compute(module_attr, data_attr, message, tmp_path):
    strat = KempnerStrategy(pp=2)
    module = CausalLM(config=TINY)
    vars(module).update(module_attr)
    strat._lightning_module = module
    data = TokenDataModule(data_dir=str(tmp_path), seq_len=8, micro_batch_size=4)
    vars(data).update(data_attr)
    with pytest.raises(MeshConfigError, match=message):
        strat.check_layout(2, strat._lightning_module, data)


def test_chat_packing_under_pp_is_refused_as_data_packing(tmp_path):
    """ChatDataModule's document mask comes from its own field, data.packing: the refusal names that one."""
    from kempnerforge.data.chat_datamodule import ChatDataModule

    strat = KempnerStrategy(pp=2)
    strat._lightning_module = CausalLM(config=TINY)
    with pytest.raises(MeshConfigError, match=r"^data.packing=True is not supported with pp=2"):
        strat.check_layout(2, strat._lightning_module, ChatDataModule(str(tmp_path), seq_len=8, micro_batch_size=4))


@pytest.mark.parametrize("tie", [False, True])
def test_joint_decoder_vlm_stages_compose_to_the_full_forward(tie):
    """A joint_decoder VLM split at its first block: stage 0 (encoder, connector, embedding, block 0) then stage 1
    (block 1, norm, head on the text positions) give the unsplit model's logits; stage 1 holds no vision part,
    and the two pruned copies' keys are the full model's, disjoint except a tied head's embedding."""
    from kempnerforge.model.vlm.model import VisionLanguageModel
    from kempnerforge.parallel.pipeline_runner import PipelineRunner
    from kempnerforge.parallel.pipeline_stage import JointDecoderStage
    from tests.vlm_tiny import tiny_connector, tiny_encoder, tiny_text, tiny_vlm

    def build():
        model = VisionLanguageModel(tiny_text(tie=tie), tiny_vlm("joint_decoder"), tiny_encoder(), tiny_connector())
        model.init_weights(seed=5)
        return model

    class Mesh:  # the runner reads only the pp degree and this rank's pp index
        def __init__(self, rank):
            self.rank = rank

        def size(self):
            return 2

        def get_local_rank(self):
            return self.rank

    full, stages = build(), []
    for rank in (0, 1):
        runner = PipelineRunner(Mesh(rank), 2, "1f1b", None, 1, None)
        part = build()
        runner.prune(part)
        (stage,) = runner.make_stages(part)
        stage.text = slice(full.n_visual, full.n_visual + 7)
        stages.append((part, stage))
    (first, s0), (last, s1) = stages
    assert last.encoder is None and last.connector is None and s1.fsdp_units() == []
    assert isinstance(s0, JointDecoderStage) and s0.fsdp_units()[-1] is first.connector
    keys0, keys1 = set(first.state_dict()), set(last.state_dict())
    assert keys0 | keys1 == set(full.state_dict())
    assert keys0 & keys1 == ({"backbone.tok_embeddings.weight"} if tie else set())
    ids, pixels = torch.randint(0, 128, (2, 7)), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits = s1(s0(ids, pixels))
        torch.testing.assert_close(logits, full(ids, pixels), rtol=0, atol=0)
