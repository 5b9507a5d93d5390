"""Loss normalization by the global target-token count of the whole optimizer step.

4 accumulated micro-batches of b sequences give the same gradients, loss and grad norm as one batch
of 4b sequences, also with padding (labels -100) spread unevenly over the micro-batches, and also
for a shorter last accumulation window at the end of an epoch.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader

from kempnerforge.config import ModelConfig
from kempnerforge.model import canonical_fqn
from kempnerforge.module import CausalLM
from kempnerforge.parallel.dtensor import to_full
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.loss import IGNORE_INDEX, StepTokenNormalizer, token_cross_entropy_sum
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16, multiple_of=16)
SEQ = 12


def _samples(n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences; sample i has its last (i * 5) % 11 labels ignored (0 to 10 of 12), a few none at all."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, CFG.vocab_size, (SEQ + 1,), generator=gen)
        labels = ids[1:].clone()
        pad = (i * 5) % 11
        if pad:
            labels[-pad:] = IGNORE_INDEX
        out.append({"input_ids": ids[:-1], "labels": labels})
    return out


class _Recording(CausalLM):
    """Snapshots the normalized gradients of every optimizer step (after normalization, no clipping)."""

    def __init__(self, grad_clip: float = 0.0) -> None:
        # eps=1e-4: Adam's first update is ~lr * sign(g), so a gradient element that is ~1e-9 (cancellation)
        # in one run and -1e-9 in the other moves 2 * lr apart; the kernels' summation order (which can differ
        # with the allocator's alignment) decides that sign. A larger eps keeps step 2's comparison about the
        # normalization, not about the sign of rounding noise.
        super().__init__(
            CFG,
            optimizer=OptimizerConfig(eps=1e-4),
            scheduler=SchedulerConfig(warmup_steps=1, total_steps=10),
            grad_clip=grad_clip,
        )
        self.grads: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.grads.append({canonical_fqn(n): to_full(p.grad).clone() for n, p in self.model.named_parameters()})
        self.losses.append(float(self.trainer.callback_metrics["train/loss"]))
        self.norms.append(float(self.trainer.callback_metrics["train/grad_norm"]))


class _StockGradNorm(Callback):
    """What a Lightning user writes to watch gradients: ``grad_norm`` in ``on_before_optimizer_step``
    (Lightning runs callbacks' hooks before the module's, so before clipping)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms.append(float(grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"]))


def _run(samples, batch_size: int, accumulate: int, steps: int, grad_clip: float = 0.0) -> _Recording:
    module = _Recording(grad_clip)
    probe = _StockGradNorm()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=KempnerStrategy(),
        max_steps=steps,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    trainer.fit(module, train_dataloaders=DataLoader(samples, batch_size=batch_size, shuffle=False))
    module.stock_norms = probe.norms
    return module


@pytest.mark.parametrize(("n_samples", "steps"), [(16, 2), (12, 2)], ids=["full-windows", "short-last-window"])
def test_accumulate_4_equals_one_batch_4x_larger_with_padding(n_samples, steps):
    """b=2: 4 micro-batches of 2 vs batches of 8. With 12 samples the 2nd step has only 2 micro-batches
    (Lightning steps at the end of the epoch) vs one batch of 4: normalized by the tokens it really had."""
    samples = _samples(n_samples)
    accumulated = _run(samples, batch_size=2, accumulate=4, steps=steps)
    single = _run(samples, batch_size=8, accumulate=1, steps=steps)
    assert len(accumulated.grads) == len(single.grads) == steps
    for step, (ga, gs) in enumerate(zip(accumulated.grads, single.grads, strict=True)):
        assert ga.keys() == gs.keys()
        for name in gs:
            torch.testing.assert_close(ga[name], gs[name], rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}")
    assert accumulated.losses == pytest.approx(single.losses, rel=1e-5)
    assert accumulated.norms == pytest.approx(single.norms, rel=1e-5)
    # the micro-batches really hold different numbers of targets, so per-micro-batch means would differ
    counts = [int((s["labels"] != IGNORE_INDEX).sum()) for s in samples]
    assert len(set(counts)) > 3


@pytest.mark.parametrize("accumulate", [1, 4])
def test_stock_grad_norm_callback_sees_the_gradients_of_the_logged_loss(accumulate):
    """Issue 17 check 4: Lightning's ``grad_norm`` read by a callback in ``on_before_optimizer_step``
    equals the logged ``train/grad_norm`` (1e-5), with clipping on (it happens after the callbacks)."""
    samples = _samples(16)
    module = _run(samples, batch_size=8 // accumulate, accumulate=accumulate, steps=2, grad_clip=0.5)
    assert len(module.stock_norms) == len(module.norms) == 2
    assert module.stock_norms == pytest.approx(module.norms, rel=1e-5)
    assert all(n > 0.5 for n in module.norms)  # clipping really applied after the callback read the norm


@pytest.mark.parametrize("accumulate", [1, 4])
def test_normalizer_matches_global_mean_gradient(accumulate):
    """Without Lightning: the scaled micro-batch losses (accumulate 4: sum-then-rescale after the last
    backward; 1: normalized before backward) give the gradient of the global mean over all tokens."""
    torch.manual_seed(0)
    w = torch.randn(8, 5, requires_grad=True)
    x = torch.randn(4, 3, 8)
    labels = torch.randint(0, 5, (4, 3))
    labels[0, :] = IGNORE_INDEX  # a micro-batch with no target at all
    labels[2, 1:] = IGNORE_INDEX
    n = (labels != IGNORE_INDEX).sum()
    token_cross_entropy_sum(x @ w, labels)[0].div(n).backward()
    expected, w.grad = w.grad.clone(), None

    normalizer = StepTokenNormalizer()
    per = 4 // accumulate  # rows per micro-batch
    for i in range(accumulate):  # what Lightning does: backward(loss / accumulate) per micro-batch
        rows = slice(i * per, (i + 1) * per)
        loss_sum, n_i = token_cross_entropy_sum(x[rows] @ w, labels[rows])
        factor = normalizer.add(loss_sum, n_i, dp_size=1, new_step=i == 0, accumulate=accumulate)
        (loss_sum * factor / accumulate).backward()
    assert normalizer.pending == (accumulate > 1)
    normalizer.finish_gradients([w], None, accumulate)  # how CausalLM.optimizer_step applies it
    assert not normalizer.pending
    torch.testing.assert_close(w.grad, expected, rtol=1e-6, atol=1e-8)
    mean, n_global = normalizer.step_loss()
    assert int(n_global) == int(n)
    full_mean = torch.nn.functional.cross_entropy((x @ w).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert float(mean) == pytest.approx(float(full_mean.detach()), rel=1e-6)


def test_new_step_drops_stale_counts_and_step_loss_needs_a_finished_step():
    normalizer = StepTokenNormalizer()
    normalizer.add(torch.tensor(100.0), torch.tensor(10), dp_size=1, new_step=True)  # a step that never finished
    factor = normalizer.add(torch.tensor(6.0), torch.tensor(3), dp_size=2, new_step=True)
    assert float(factor) == pytest.approx(2 / 3)  # dp_size / N: FSDP2 averages over the dp ranks
    mean, n = normalizer.step_loss()
    assert (float(mean), float(n)) == (2.0, 3.0)
    with pytest.raises(RuntimeError, match=r"step_loss\(\) called without a micro-batch"):
        normalizer.step_loss()
    assert normalizer.add(torch.tensor(6.0), torch.tensor(3), dp_size=2, new_step=True, accumulate=2) == 2.0
    with pytest.raises(RuntimeError, match=r"before finish_gradients\(\)"):
        normalizer.step_loss()
