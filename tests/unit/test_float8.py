"""FP8 (torchao float8 training): the module swap, the filter, the refusals, and a tiny step on CPU.

``_scaled_mm`` runs at ~60 MFLOP/s on CPU (NOTES-platform.md): every FP8 forward here is dim 32 and
a few tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.parallel import float8 as f8
from kempnerforge.parallel.dtensor import to_full
from kempnerforge.parallel.float8 import (
    Float8ConfigError,
    apply_float8,
    float8_module_filter,
    validate_float8,
)
from kempnerforge.parallel.order import TransformOrderError, applied_steps, record_step

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

# The default fused projections: wqkv 32 -> (4 + 2 * 2) * 8 = 64 and w13 32 -> 2 * 40 = 80 convert; ffn_hidden_dim=40
# makes w2 (40 -> 32) a Linear whose in-features are not a multiple of 16: it must stay nn.Linear.
CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16, ffn_hidden_dim=40)


def _swapped(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))


@pytest.mark.parametrize(
    ("module", "fqn", "expected"),
    [
        (nn.Linear(32, 64), "layers.0.attention.wqkv", True),
        (nn.Linear(32, 64), "layers.0._checkpoint_wrapped_module.attention.wqkv", True),
        (nn.Linear(32, 64), "layers.0.attention.wq", True),  # unfused (fuse_qkv=False)
        (nn.Linear(32, 40), "layers.0.feed_forward.w13", False),  # out not a multiple of 16
        (nn.Linear(32, 40), "layers.0.feed_forward.w1", False),
        (nn.Linear(40, 32), "layers.0.feed_forward.w2", False),  # in not a multiple of 16
        (nn.Linear(32, 96), "output", False),  # the head
        (nn.Linear(32, 64), "layers.1.moe.experts.0.w1", False),
        (nn.Linear(32, 16), "layers.1.moe.router.gate", False),
        (nn.Embedding(96, 32), "tok_embeddings", False),
        (nn.Linear(32, 64), "layers.0.output_proj", True),  # only the exact head FQN is skipped
    ],
)
def test_filter(module, fqn, expected):
    assert float8_module_filter(module, fqn) is expected


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_swap_on_meta_model_converts_exactly_the_eligible_linears(recipe):
    with torch.device("meta"):
        model = Transformer(CFG)
    converted = apply_float8(model, recipe)
    expected = sorted(
        f"layers.{i}.{w}" for i in range(2) for w in ("attention.wqkv", "attention.wo", "feed_forward.w13")
    )
    assert sorted(converted) == _swapped(model) == expected
    assert type(model.output) is nn.Linear and type(model.layers["0"].feed_forward.w2) is nn.Linear
    assert applied_steps(model) == ["float8"]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in Transformer(CFG).named_parameters()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tiny_fp8_step_runs_and_is_close_to_fp32(recipe):
    reference = Transformer(CFG)
    reference.init_weights(seed=0)
    model = Transformer(CFG)
    model.init_weights(seed=0)
    apply_float8(model, recipe)
    tokens = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    out, ref = model(tokens), reference(tokens)
    out.float().logsumexp(-1).sum().backward()
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()  # fp8 quantization error, not garbage
    grad = model.layers["0"].attention.wqkv.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_float8_all_gather_with_fsdp2_world_1(gloo_world_1):
    """tensorwise + float8 all-gather: FSDP2 shards the float8-cast weight wrapper; meta init and a step work."""
    from torch.distributed.device_mesh import init_device_mesh

    from kempnerforge.parallel.fsdp import apply_fsdp

    with torch.device("meta"):
        model = Transformer(CFG)
    apply_float8(model, "tensorwise", all_gather=True)
    apply_fsdp(model, init_device_mesh("cpu", (1,)))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=0)
    reference = Transformer(CFG)
    reference.init_weights(seed=0)
    w = model.layers["0"].attention.wqkv.weight
    assert torch.equal(to_full(w).float(), reference.layers["0"].attention.wqkv.weight)
    tokens = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    model(tokens).float().logsumexp(-1).sum().backward()
    assert torch.isfinite(to_full(w.grad)).all()


def test_recipe_none_only_records_the_step():
    model = Transformer(CFG)
    assert apply_float8(model, None) == []
    assert _swapped(model) == [] and applied_steps(model) == ["float8"]


def test_fp8_after_activation_checkpointing_raises():
    model = Transformer(CFG)
    record_step(model, "activation_checkpoint")
    with pytest.raises(TransformOrderError, match="Cannot apply 'float8' after 'activation_checkpoint'"):
        apply_float8(model, "tensorwise")


def test_nothing_to_convert_raises():
    cfg = ModelConfig(dim=24, n_layers=1, n_heads=4, vocab_size=96, max_seq_len=16, ffn_hidden_dim=40)
    with pytest.raises(Float8ConfigError, match=r"float8_recipe='tensorwise' converts no Linear"):
        apply_float8(Transformer(cfg), "tensorwise")


def _recipes() -> list[str]:
    from torchao.float8 import Float8LinearRecipeName

    return [r.value for r in Float8LinearRecipeName]


@pytest.mark.parametrize(
    ("recipe", "all_gather", "message"),
    [
        (
            "fp8",
            False,
            "float8_recipe='fp8' is not a recipe of the installed torchao; choose one of {recipes} (or None to disable FP8).",
        ),
        (
            "rowwise",
            True,
            "float8_all_gather=True needs float8_recipe='tensorwise' (torchao all-gathers only per-tensor scaled weights); got float8_recipe='rowwise'.",
        ),
        (None, True, "float8_all_gather=True needs FP8: set float8_recipe='tensorwise'."),
    ],
)
def test_validation_messages(recipe, all_gather, message):
    with pytest.raises(Float8ConfigError) as err:
        validate_float8(recipe, all_gather)
    assert str(err.value) == message.format(recipes=_recipes())


@pytest.mark.parametrize(("version", "found"), [(None, "not installed"), ((0, 17), "version 0.17")])
def test_missing_or_old_torchao_is_a_clear_error(monkeypatch, version, found):
    monkeypatch.setattr(f8, "_torchao_version", lambda: version)
    with pytest.raises(Float8ConfigError) as err:
        validate_float8("tensorwise", False)
    assert str(err.value) == (
        f"float8_recipe needs torchao>=0.18 (found: {found}); install the extra: pip install "
        "'kempnerforge[float8]' (torchao has no dependencies and leaves torch as is)."
    )
    validate_float8(None, False)  # FP8 off needs no torchao


def test_valid_settings_pass():
    from kempnerforge.strategies import KempnerStrategy

    for recipe in ("tensorwise", "rowwise"):
        validate_float8(recipe, False)
        assert KempnerStrategy(float8_recipe=recipe).float8_recipe == recipe
    validate_float8("tensorwise", True)
    assert KempnerStrategy(float8_recipe="tensorwise", float8_all_gather=True).float8_all_gather is True
    # FP8 composes with TP (tests/distributed/test_float8_tp.py): every recipe is accepted with tp > 1.
    for recipe in ("tensorwise", "rowwise"):
        assert KempnerStrategy(tp=2, float8_recipe=recipe).float8_recipe == recipe


def test_strategy_applies_fp8_in_the_chain():
    """KempnerStrategy(float8_recipe=...) converts the block Linears before FSDP2 and trains one step."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from kempnerforge.module import CausalLM
    from kempnerforge.strategies import KempnerStrategy
    from kempnerforge.training.lr import SchedulerConfig

    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    samples = [{"input_ids": r[:-1], "labels": r[1:]} for r in ids]
    module = CausalLM(CFG, scheduler=SchedulerConfig(warmup_steps=1, total_steps=2))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=KempnerStrategy(float8_recipe="rowwise"),
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=DataLoader(samples, batch_size=1))
    assert _swapped(module.model) == sorted(
        f"layers.{i}.{w}" for i in range(2) for w in ("attention.wqkv", "attention.wo", "feed_forward.w13")
    )
    assert applied_steps(module.model) == ["ep", "float8", "activation_checkpoint", "compile", "fsdp"]
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"float8_recipe": "e4m3"},
            Float8ConfigError,
            "float8_recipe='e4m3' is not a recipe of the installed torchao",
        ),
        (
            {"float8_recipe": "rowwise", "float8_all_gather": True},
            Float8ConfigError,
            "float8_all_gather=True needs float8_recipe='tensorwise'",
        ),
        (
            {"activation_checkpointing": "partial"},
            ValueError,
            "activation_checkpointing='partial' is not allowed",
        ),
        (
            {"activation_checkpointing": "selective", "ac_every_n": 0},
            ValueError,
            "ac_every_n=0 is not allowed",
        ),
        ({"compile": "yes"}, ValueError, "compile='yes' is not allowed; use True or False."),
        ({"compile": True, "compile_backend": "cudagraphs"}, ValueError, "compile_backend='cudagraphs' is not allowed"),
    ],
)
def test_strategy_refuses_bad_chain_settings_at_construction(kwargs, error, message):
    """Raised by the constructor: before any process group, mesh or tensor exists."""
    from kempnerforge.strategies import KempnerStrategy

    with pytest.raises(error) as err:
        KempnerStrategy(**kwargs)
    assert str(err.value).startswith(message)


# -- FP8 + TP: the plan rewrite the TP step applies (no mesh needed: it only converts and picks styles) ----------

TP_CFG = ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=96, max_seq_len=16, ffn_hidden_dim=32)


def _block_plan(model, recipe, tp=2):
    plan = model.tp_plan(sequence_parallel=True, loss_parallel=True)
    return f8.float8_tp_plan(model.layers["0"], plan.block, recipe, tp=tp, prefix="layers.0.")


def test_float8_tp_plan_tensorwise_uses_torchao_float8_styles():
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    model = Transformer(TP_CFG)
    plan = _block_plan(model, "tensorwise")
    styles = {k: type(v).__name__ for k, v in plan.items()}
    assert styles == {
        "attention.wqkv": "Float8ColwiseParallel",
        "feed_forward.w13": "Float8ColwiseParallel",
        "attention.wo": "Float8RowwiseParallel",
        "feed_forward.w2": "Float8RowwiseParallel",
        "attention_norm": "SequenceParallel",
        "ffn_norm": "SequenceParallel",
        "attention": "PrepareFloat8ModuleInput",
        "feed_forward": "PrepareFloat8ModuleInput",
    }
    assert isinstance(plan["attention.wqkv"], Float8ColwiseParallel)
    assert isinstance(plan["feed_forward.w2"], Float8RowwiseParallel)
    assert isinstance(plan["attention"], PrepareFloat8ModuleInput)
    converted = sorted(n for n, m in model.layers["0"].named_modules() if isinstance(m, Float8Linear))
    assert converted == ["attention.wo", "attention.wqkv", "feed_forward.w13", "feed_forward.w2"]
    assert _swapped(model.layers["1"]) == []  # only the block it was given


def test_float8_tp_plan_rowwise_converts_but_keeps_the_stock_styles():
    model = Transformer(TP_CFG)
    stock = model.tp_plan(sequence_parallel=True, loss_parallel=True).block
    plan = _block_plan(model, "rowwise")
    assert {k: type(v) for k, v in plan.items()} == {k: type(v) for k, v in stock.items()}
    assert len(_swapped(model.layers["0"])) == 4  # wqkv, wo, w13, w2


def test_float8_tp_plan_keeps_linears_whose_tp_shard_is_not_a_multiple_of_16():
    """n_kv_heads=2 of 8 channels: wk / wv are 32 -> 16, 8 per TP rank: they stay nn.Linear with stock styles, and
    the attention input is not cast to float8 before its all-gather (wk / wv read it in high precision)."""
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16, ffn_hidden_dim=32,
                      fuse_qkv=False, fuse_w13=False)  # fmt: skip  # separate wk / wv: the small GEMMs
    model = Transformer(cfg)
    plan = _block_plan(model, "tensorwise")
    attn = model.layers["0"].attention
    assert isinstance(attn.wq, Float8Linear) and type(attn.wk) is nn.Linear and type(attn.wv) is nn.Linear
    assert type(plan["attention.wk"]).__name__ == "ColwiseParallel"
    assert type(plan["attention.wq"]).__name__ == "Float8ColwiseParallel"
    assert type(plan["attention"]).__name__ == "PrepareModuleInput"
    assert type(plan["feed_forward"]).__name__ == "PrepareFloat8ModuleInput"
    # tp=1 would convert wk / wv (16 is a multiple of 16): the rule is the per-rank GEMM size
    assert float8_module_filter(nn.Linear(32, 16), "layers.0.attention.wk", out_shards=1)
    assert not float8_module_filter(nn.Linear(32, 16), "layers.0.attention.wk", out_shards=2)
    assert not float8_module_filter(nn.Linear(16, 32), "layers.0.attention.wo", in_shards=2)


def test_fp8_step_after_tp_conversion_needs_the_same_settings():
    model = Transformer(TP_CFG)
    record_step(model, "tp")
    _block_plan(model, "tensorwise")
    with pytest.raises(Float8ConfigError, match=r"float8_recipe='rowwise', float8_all_gather=False differ from"):
        apply_float8(model, "rowwise")


def test_fp8_step_after_tp_conversion_converts_the_rest_and_lists_all():
    model = Transformer(TP_CFG)
    record_step(model, "tp")
    _block_plan(model, "tensorwise")
    converted = apply_float8(model, "tensorwise")
    assert sorted(converted) == _swapped(model) and len(converted) == 8  # 4 by the TP step, 4 (block 1) here
    assert applied_steps(model) == ["tp", "float8"]


def test_tp_after_fp8_still_raises():
    """The TP step's own conversion does not loosen the order: TP after the FP8 step is refused."""
    from kempnerforge.parallel.tensor_parallel import apply_tp

    model = Transformer(TP_CFG)
    apply_float8(model, "tensorwise")
    with pytest.raises(TransformOrderError, match="Cannot apply 'tp' after 'float8'"):
        apply_tp(model, None, sequence_parallel=False, loss_parallel=True, float8_recipe="tensorwise")
