"""Issue 17 check 1 (precision) and check 3 (clipping), one process on CPU.

- ``mixed_precision_param=auto``: bf16 on CUDA, fp32 on CPU; the policy line printed with the mesh.
- A test per ``trainer.precision`` value Lightning accepts: ``32-true`` keeps the strategy's policy,
  ``bf16-mixed`` is the same run as ``mixed_precision_param=bfloat16`` (bit-identical losses, fp32 master
  weights, no autocast), ``bf16-true`` / ``16-true`` hold 16-bit parameters and optimizer states and train
  like a plain PyTorch loop on the same 16-bit model; every other value is refused before any process group.
- ``trainer.gradient_clip_val`` is refused (with TP, with FSDP2, and under a stock strategy) with a message
  naming ``model.grad_clip``, before rendezvous where the strategy is ours.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from kempnerforge.config import ModelConfig
from kempnerforge.module import CausalLM
from kempnerforge.parallel.precision import (
    apply_matmul_precision,
    describe_precision,
    resolve_param_dtype,
    trainer_precision_to_param,
)
from kempnerforge.strategies import KempnerStrategy
from tests.e2e.inprocess import kforge_in_process

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=16, multiple_of=16)
FIELD = "trainer.strategy.init_args.mixed_precision_param"
REFUSED = ["16-mixed", "64-true", "transformer-engine", "transformer-engine-float16"]


def _trainer(strategy: KempnerStrategy | str = "auto", steps: int = 2, callbacks=(), **kw) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, limit_val_batches=0,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=list(callbacks), **kw)  # fmt: skip


def _samples():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (8, 17), generator=gen)
    return DataLoader([{"input_ids": r[:-1], "labels": r[1:]} for r in ids], batch_size=4)


def test_auto_is_bf16_on_cuda_and_fp32_elsewhere():
    assert resolve_param_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_param_dtype("auto", "cpu") == torch.float32
    assert resolve_param_dtype("float32", "cuda") == torch.float32
    assert resolve_param_dtype("bfloat16", "cpu") == torch.bfloat16
    assert KempnerStrategy().mixed_precision_param == "auto"  # the default


def test_policy_line_names_compute_master_weights_reduction_and_tf32():
    line = describe_precision(torch.bfloat16, torch.float32, "high", "cuda")
    assert line == (
        "precision: bf16 compute, fp32 master weights (FSDP2 MixedPrecisionPolicy), fp32 gradient reduction, "
        "fp32 matmuls in TF32 (float32_matmul_precision=high)"
    )
    assert describe_precision(torch.float32, torch.float32, "high", "cpu") == (
        "precision: fp32 compute and weights, fp32 gradient reduction"
    )


def test_tf32_is_set_on_cuda_only_and_can_be_opted_out():
    before = torch.get_float32_matmul_precision()
    try:
        apply_matmul_precision("high", "cpu")
        assert torch.get_float32_matmul_precision() == before  # CPU keeps exact fp32 matmuls
        apply_matmul_precision("high", "cuda")
        assert torch.get_float32_matmul_precision() == "high"
        apply_matmul_precision("highest", "cuda")  # the opt-out
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
    with pytest.raises(ValueError, match=r"float32_matmul_precision='tf32' is not allowed"):
        KempnerStrategy(float32_matmul_precision="tf32")


@pytest.mark.parametrize("precision", ["32-true", "32", 32])
def test_32_true_keeps_the_strategy_policy(precision):
    strategy = KempnerStrategy(mixed_precision_param="bfloat16")
    _trainer(strategy, precision=precision)
    assert type(strategy.precision_plugin) is Precision
    assert strategy.mixed_precision_param == "bfloat16"
    assert KempnerStrategy().mixed_precision_param == "auto"


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_bf16_mixed_maps_onto_the_fsdp2_policy(precision):
    strategy = KempnerStrategy()
    _trainer(strategy, precision=precision)
    assert type(strategy.precision_plugin) is Precision  # no autocast plugin
    assert strategy.mixed_precision_param == "bfloat16" and strategy.param_dtype == torch.bfloat16


def test_a_custom_precision_plugin_is_refused_not_dropped():
    class MyPrecision(Precision):
        pass

    with pytest.raises(
        ValueError, match=rf"trainer.plugins: the precision plugin MyPrecision is not supported.*{FIELD}"
    ):
        _trainer(KempnerStrategy(), plugins=[MyPrecision()])


def test_bf16_mixed_contradicting_float32_is_refused():
    with pytest.raises(ValueError, match=rf"trainer.precision='bf16-mixed' contradicts {FIELD}='float32'"):
        _trainer(KempnerStrategy(mixed_precision_param="float32"), precision="bf16-mixed")


@pytest.mark.parametrize(
    "precision, param", [("bf16-true", "float32"), ("16-true", "bfloat16"), ("16-true", "float32")]
)
def test_true_half_contradicting_the_policy_is_refused(precision, param):
    with pytest.raises(ValueError, match=rf"trainer.precision='{precision}' contradicts {FIELD}='{param}'"):
        _trainer(KempnerStrategy(mixed_precision_param=param), precision=precision)
    assert not dist.is_initialized()


def test_true_half_with_float8_is_refused():
    with pytest.raises(ValueError, match="cannot be combined with float8_recipe"):
        _trainer(KempnerStrategy(float8_recipe="tensorwise"), precision="bf16-true")


@pytest.mark.parametrize("precision", ["16-mixed", "16", "64-true", "transformer-engine", "transformer-engine-float16"])
def test_other_precisions_are_refused_by_lightning_for_model_parallel(precision):
    """Lightning refuses these for any ModelParallelStrategy while the Trainer is built (its own message);
    the CLI gives ours (test below), the mapping function too."""
    with pytest.raises(ValueError, match="does not support"):
        _trainer(KempnerStrategy(), precision=precision)
    with pytest.raises(ValueError, match=FIELD):
        trainer_precision_to_param(precision, "auto")


@pytest.mark.parametrize("precision", REFUSED)
def test_cli_refuses_every_other_precision_in_one_line(precision):
    proc = kforge_in_process("fit", "--config", "configs/debug.yaml", f"--trainer.precision={precision}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kforge: error: trainer.precision='{precision}' is not supported by KempnerStrategy")
    assert FIELD in last


class _Probe(Callback):
    """Records the losses, whether autocast was on in the forward, and the dtype of what the head computes on
    (the final norm's output: the default fused head + loss reads the head weight without calling the module)."""

    def __init__(self) -> None:
        self.losses, self.autocast, self.head_input_dtype, self.batches = [], [], None, []

    def on_train_start(self, trainer, pl_module) -> None:
        def hook(_m, _args, out):
            self.autocast.append(torch.is_autocast_enabled("cpu"))
            self.head_input_dtype = out.dtype

        pl_module.model.norm.register_forward_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.batches.append({k: v.clone() for k, v in batch.items()})  # in the sampler's order


def _fit(strategy: KempnerStrategy, **kw) -> tuple[_Probe, CausalLM]:
    probe, module = _Probe(), CausalLM(CFG, init_seed=1)
    _trainer(strategy, callbacks=[probe], **kw).fit(module, _samples())
    return probe, module


def test_bf16_mixed_is_the_same_run_as_the_bf16_policy_with_fp32_master_weights():
    """One mechanism: trainer.precision=bf16-mixed == mixed_precision_param=bfloat16 bit for bit, a bf16 head,
    no autocast, fp32 sharded parameters; and it differs from the fp32 run (bf16 compute really happens)."""
    mixed, module = _fit(KempnerStrategy(), precision="bf16-mixed")
    policy, _ = _fit(KempnerStrategy(mixed_precision_param="bfloat16"))
    fp32, _ = _fit(KempnerStrategy())
    assert mixed.losses == policy.losses and len(mixed.losses) == 2
    assert mixed.losses != fp32.losses
    assert mixed.losses == pytest.approx(fp32.losses, rel=2e-2)
    assert mixed.head_input_dtype == torch.bfloat16 and fp32.head_input_dtype == torch.float32
    assert not any(mixed.autocast)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in module.model.parameters())


def test_policy_is_logged_with_the_mesh(caplog):
    with caplog.at_level("INFO"):
        _trainer(KempnerStrategy(), steps=1).fit(CausalLM(CFG), _samples())
    line = next(r.getMessage() for r in caplog.records if "DeviceMesh [" in r.getMessage())
    assert line.endswith("; precision: fp32 compute and weights, fp32 gradient reduction"), line


# -- check 3: trainer.gradient_clip_val ---------------------------------------------------------------------

CLIP_MSG = r"trainer.gradient_clip_val=0.5 is not supported: .*set model.grad_clip=0.5"


@pytest.mark.parametrize("degrees", [{"tp": 2}, {"dp_shard": 2}], ids=["tp2", "fsdp2"])
def test_gradient_clip_val_is_refused_before_rendezvous(degrees):
    """With TP and with FSDP2 the strategy refuses it first thing in setup_environment: no process group."""
    with pytest.raises(ValueError, match=CLIP_MSG):
        _trainer(KempnerStrategy(**degrees), gradient_clip_val=0.5).fit(CausalLM(CFG), _samples())
    assert not dist.is_initialized()


def test_gradient_clip_val_is_refused_under_a_stock_strategy_too():
    """No silent second clip anywhere: the module's configure_gradient_clipping refuses it."""
    with pytest.raises(ValueError, match=CLIP_MSG):
        _trainer("auto", gradient_clip_val=0.5).fit(CausalLM(CFG), _samples())


def test_gradient_clip_val_zero_is_lightnings_off_and_passes():
    """0 is Lightning's "off": accepted, the step runs and the module's own clipping (model.grad_clip) still logs."""
    trainer = _trainer(KempnerStrategy(), steps=1, gradient_clip_val=0)
    trainer.fit(CausalLM(CFG), _samples())
    assert trainer.global_step == 1
    assert float(trainer.callback_metrics["train/grad_norm"]) > 0


def test_cli_refuses_gradient_clip_val_in_one_line():
    proc = kforge_in_process("fit", "--config", "configs/debug.yaml", "--trainer.gradient_clip_val=0.5")
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kforge: error: trainer.gradient_clip_val=0.5 is not supported"), last
    assert "model.grad_clip=0.5" in last


def _plain_loop_losses(dtype: torch.dtype, batches: list[dict], steps: int = 2) -> list[float]:
    """The oracle for bf16-true / 16-true: the same initial model cast to ``dtype`` (buffers kept fp32, as here),
    plain PyTorch AdamW on its 16-bit parameters with the same schedule, the same batches, no strategy at all."""
    from kempnerforge.parallel.precision import cast_parameters_

    module = CausalLM(CFG, init_seed=1)
    module.configure_model()
    module.model.to_empty(device="cpu")
    with torch.no_grad():
        module.model.init_weights(seed=1)
    cast_parameters_(module.model, dtype)
    trainer = _trainer(steps=steps)
    module.trainer = trainer  # configure_optimizers reads max_steps
    opt_cfg = module.configure_optimizers()
    optimizer, scheduler = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    losses = []
    for batch in batches[:steps]:
        optimizer.zero_grad()
        logits = module.model(batch["input_ids"]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.model.parameters(), module.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("precision, dtype", [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_half_holds_16_bit_parameters_and_states_and_trains_like_a_plain_16_bit_loop(precision, dtype):
    probe, module = _fit(KempnerStrategy(), precision=precision)
    assert all(isinstance(p, DTensor) and p.dtype == dtype for p in module.model.parameters())
    assert all(b.dtype == torch.float32 for b in module.model.buffers() if b.is_floating_point())  # RoPE tables
    states = module.trainer.optimizers[0].state.values()
    assert {v.dtype for st in states for v in st.values() if torch.is_tensor(v) and v.dim() > 0} == {dtype}
    assert probe.head_input_dtype == dtype and not any(probe.autocast)
    plain = _plain_loop_losses(dtype, probe.batches)
    fp32 = _plain_loop_losses(torch.float32, probe.batches)
    assert probe.losses == pytest.approx(plain, rel=1e-6), (probe.losses, plain)  # measured: 1e-7
    if dtype == torch.bfloat16:  # bf16's 8-bit mantissa moves the first loss by 1.4e-5 here (fp16's 10 bits: 1e-6)
        assert probe.losses[0] != pytest.approx(fp32[0], rel=5e-6), (probe.losses, fp32)
