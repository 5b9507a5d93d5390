"""Each observability callback in a plain Lightning project (lightning.pytorch.demos, no KempnerStrategy),
plus real-value checks: profiler trace loads, memory peak, health stop checkpoint, captured activations."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.transformer import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

from kempnerforge.callbacks import ActivationCapture, HealthCheck, MemoryMonitor, MFUMonitor, StepProfiler
from kempnerforge.config import ModelConfig
from kempnerforge.metrics.health import DeviceHealth
from kempnerforge.model.hooks import attention_probs
from kempnerforge.model.rope import pack_rope
from kempnerforge.module import CausalLM
from kempnerforge.training.lr import SchedulerConfig

VOCAB, SEQ, BATCH = 64, 16, 4


class DemoTransformer(LightningTransformer):
    """Lightning's demo transformer on synthetic tokens (its WikiText2 would download)."""

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (4 * BATCH, SEQ + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def _plain_trainer(tmp_path, callbacks, **kw) -> Trainer:
    base = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),
        "callbacks": callbacks,
    }
    return Trainer(**{**base, **kw})


def test_mfu_monitor_plain_lightning(tmp_path):
    cb = MFUMonitor(flops_per_token=1_000_000, peak_flops=1e12)
    trainer = _plain_trainer(tmp_path, [cb], fast_dev_run=True)
    trainer.fit(DemoTransformer(vocab_size=VOCAB))
    tps = cb.last["tokens_per_s"]
    assert tps > 0 and cb.last["tokens_per_s_per_device"] == tps  # one device, all data-parallel
    assert cb.last["mfu"] == pytest.approx(tps * 1e6 / 1e12)
    assert trainer.callback_metrics["train/mfu"].item() == pytest.approx(cb.last["mfu"], rel=1e-6)


def test_memory_monitor_plain_lightning_reports_positive_peak(tmp_path):
    cb = MemoryMonitor()
    trainer = _plain_trainer(tmp_path, [cb], fast_dev_run=True)
    trainer.fit(DemoTransformer(vocab_size=VOCAB))
    assert cb.last["peak"] > 0.05  # GiB: this process holds torch and Lightning
    assert cb.last["peak"] >= 0.99 * cb.last["rss"] > 0  # peak (KiB counter) vs current RSS (pages)
    assert trainer.callback_metrics["memory/peak_gb"].item() == pytest.approx(cb.last["peak"], rel=1e-6)


def test_memory_snapshots_refused_on_cpu(tmp_path):
    trainer = _plain_trainer(tmp_path, [MemoryMonitor(snapshot_steps=[1])], fast_dev_run=True)
    with pytest.raises(ValueError, match="snapshot_steps=\\[1\\] needs a CUDA device"):
        trainer.fit(DemoTransformer(vocab_size=VOCAB))


def test_profiler_plain_lightning_writes_a_trace_that_loads(tmp_path):
    cb = StepProfiler(dirpath=str(tmp_path / "prof"), start_step=1, warmup=1, active=1)
    trainer = _plain_trainer(tmp_path, [cb], max_steps=4)
    trainer.fit(DemoTransformer(vocab_size=VOCAB))
    (trace,) = cb.traces
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert "ProfilerStep#2" in names  # the one active step (0 skipped, 1 warm-up)
    assert any(n.startswith("aten::addmm") or n.startswith("aten::mm") for n in names)
    assert "aten::" in (tmp_path / "prof" / "top_ops_rank0.txt").read_text()


def test_health_check_plain_lightning(tmp_path):
    cb = HealthCheck(every_n_steps=1, collective_timeout_s=5)
    trainer = _plain_trainer(tmp_path, [cb], fast_dev_run=True)
    trainer.fit(DemoTransformer(vocab_size=VOCAB))
    assert cb.checks == 2 and cb.failure is None  # at start and after step 1


class _FailsAtStep(HealthCheck):
    def __init__(self, fail_step: int, **kw) -> None:
        super().__init__(**kw)
        self.fail_step = fail_step
        self._trainer = None

    def on_train_start(self, trainer, pl_module):
        self._trainer = trainer
        super().on_train_start(trainer, pl_module)

    def check_device(self, device):
        if self._trainer.global_step == self.fail_step:
            return DeviceHealth(False, "injected: matmul mismatch")
        return super().check_device(device)


def test_health_failure_stops_with_a_checkpoint(tmp_path):
    cb = _FailsAtStep(fail_step=2, every_n_steps=1, dirpath=str(tmp_path / "stop"))
    model = DemoTransformer(vocab_size=VOCAB)
    trainer = _plain_trainer(tmp_path, [cb], max_steps=10, enable_checkpointing=False)
    trainer.fit(model)
    assert trainer.global_step == 2 and cb.failure == {"step": 2, "ranks": [0], "reason": "injected: matmul mismatch"}
    ckpt = torch.load(cb.stop_checkpoint, weights_only=False)
    assert cb.stop_checkpoint.name == "health-step=000002.ckpt" and ckpt["global_step"] == 2
    for name, value in model.state_dict().items():
        assert torch.equal(ckpt["state_dict"][name], value), name


def test_activation_capture_plain_lightning(tmp_path):
    cb = ActivationCapture(layers=["model.transformer.encoder.layers.0", "model.decoder"], dirpath=str(tmp_path))
    trainer = _plain_trainer(tmp_path, [cb], fast_dev_run=True)
    trainer.fit(DemoTransformer(vocab_size=VOCAB))
    (path,) = cb.saved
    data = np.load(path)
    assert data["model.transformer.encoder.layers.0"].shape == (BATCH, SEQ, 200)  # demo: batch_first, ninp 200
    assert data["model.decoder"].shape == (BATCH, SEQ, VOCAB)
    assert np.isfinite(data["model.decoder"]).all()
    with pytest.raises(ValueError, match="not a kempnerforge Attention"):
        ActivationCapture(attention_layers=["model.transformer.encoder.layers.0.self_attn"])._modules(
            DemoTransformer(vocab_size=VOCAB)
        )


TINY = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": VOCAB, "max_seq_len": SEQ}


def test_attention_probs_match_sdpa():
    from kempnerforge.model import Transformer

    model = Transformer(ModelConfig(**TINY, multiple_of=16, qk_norm=True))
    model.init_weights(seed=0)
    attn = model.layers["1"].attention
    x = torch.randn(2, SEQ, 32)
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    probs = attention_probs(attn, x, cos, sin)
    assert probs.shape == (2, 4, SEQ, SEQ)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, SEQ))
    assert probs.triu(1).abs().max() == 0  # causal
    # The default fused wqkv: per KV group (2), its 2 query heads, then k, then v (index 3), 8 channels each.
    v = attn.wqkv(x).view(2, SEQ, 2, 4, 8)[:, :, :, 3].transpose(1, 2).repeat_interleave(2, dim=1)
    out = attn.wo((probs @ v).transpose(1, 2).reshape(2, SEQ, 32))
    torch.testing.assert_close(out, attn(x, cos, sin), atol=1e-6, rtol=1e-5)


def test_activation_capture_of_causal_lm_equals_a_direct_forward(tmp_path):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    batches = [{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}] * 2
    cb = ActivationCapture(
        layers=["model.layers.0"], attention_layers=["model.layers.1.attention"], steps=[1], dirpath=str(tmp_path)
    )
    module = CausalLM(ModelConfig(**TINY, multiple_of=16), scheduler=SchedulerConfig(warmup_steps=1, total_steps=2))
    trainer = _plain_trainer(tmp_path, [cb], max_steps=2, enable_checkpointing=False)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    (path,) = cb.saved
    assert path.name == "activations_step1_rank0.npz"
    data = np.load(path)
    # Oracle: step 1 runs on the weights after one update; a fresh module trained one step on the same
    # batch has them, and a direct forward of it gives layer 0's output and layer 1's probabilities.
    ref = CausalLM(ModelConfig(**TINY, multiple_of=16), scheduler=SchedulerConfig(warmup_steps=1, total_steps=2))
    _plain_trainer(tmp_path / "ref", [], max_steps=1, enable_checkpointing=False).fit(
        ref, train_dataloaders=DataLoader(batches[:1], batch_size=None)
    )
    m = ref.model
    with torch.no_grad():
        cos, sin = m.rope_cos[:SEQ], m.rope_sin[:SEQ]
        h0 = m.layers["0"](m.tok_embeddings(batches[0]["input_ids"]), pack_rope(cos, sin))
        probs = attention_probs(m.layers["1"].attention, m.layers["1"].attention_norm(h0), cos, sin)
    np.testing.assert_allclose(data["model.layers.0"], h0.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(data["model.layers.1.attention.attn_probs"], probs.numpy(), rtol=1e-5, atol=1e-6)
