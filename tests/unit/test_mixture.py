"""Issue 8 check 5: mixture proportions, annealing phases at their step, exact replay on resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer

from kempnerforge.config import ModelConfig
from kempnerforge.data.mixture import AnnealingPhase, MixtureSampler, MixtureSchedule, MixtureSource
from kempnerforge.data.mixture_datamodule import MixtureDataModule
from kempnerforge.data.prepare import prepare_data
from kempnerforge.module import CausalLM
from kempnerforge.training.lr import SchedulerConfig, build_scheduler
from tests.conftest import GPT2_TOKENIZER, SHAKESPEARE

SRC = [MixtureSource("a", "-", 5.0), MixtureSource("b", "-", 3.0), MixtureSource("c", "-", 2.0)]
SIZES = [300, 200, 100]


def _draw(sampler: MixtureSampler, n: int) -> np.ndarray:
    return np.array([sampler.source_of(next(sampler)) for _ in range(n)])


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_realized_proportions_match_the_weights_within_2_percent(temperature):
    sampler = MixtureSampler(SIZES, MixtureSchedule(SRC, [], temperature), samples_per_step=8, seed=3)
    frac = np.bincount(_draw(sampler, 10_000), minlength=3) / 10_000
    w = np.array([5.0, 3.0, 2.0]) ** (1 / temperature)
    np.testing.assert_allclose(frac, w / w.sum(), atol=0.02)


def test_phase_switches_at_its_step_and_scales_the_lr():
    schedule = MixtureSchedule(SRC, [AnnealingPhase(start_step=10, weights={"c": 1.0}, lr_scale=0.5)])
    sampler = MixtureSampler(SIZES, schedule, samples_per_step=8, seed=0)
    src = _draw(sampler, 160)
    assert set(src[:80]) == {0, 1, 2} and set(src[80:]) == {2}  # steps 0-9 mixed, step 10 on: only "c"
    assert [schedule.lr_scale(s) for s in (0, 9, 10, 50)] == [1.0, 1.0, 0.5, 0.5]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_scheduler(opt, SchedulerConfig(warmup_steps=0, decay="constant"), 100, schedule.lr_scale)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[9] == 1.0 and lrs[10] == 0.5 and lrs[11] == 0.5


def test_data_parallel_ranks_split_the_single_process_sequence():
    schedule = MixtureSchedule(SRC, [AnnealingPhase(4, {"a": 1.0, "b": 1.0})])
    one = [next(MixtureSampler(SIZES, schedule, 8, seed=1)) for _ in range(1)]
    single = MixtureSampler(SIZES, schedule, 8, seed=1)
    seq = [next(single) for _ in range(64)]
    ranks = [MixtureSampler(SIZES, schedule, 8, rank=r, num_replicas=2, seed=1) for r in range(2)]
    per_rank = [[next(s) for _ in range(32)] for s in ranks]
    assert seq[0::2] == per_rank[0] and seq[1::2] == per_rank[1] and one == seq[:1]
    # without replacement inside a source: the first 300 draws of "a" are a permutation of its windows
    fresh = MixtureSampler(SIZES, schedule, 8, seed=1)
    drawn = [i for i in (next(fresh) for _ in range(3000)) if i < 300]
    assert len(set(drawn[:300])) == 300


@pytest.mark.parametrize(
    "sources,phases,temperature,match",
    [
        ([MixtureSource("a", "-"), MixtureSource("a", "-")], [], 1.0, r"source names must be unique"),
        (SRC, [AnnealingPhase(3, {"zz": 1.0})], 1.0, r"names unknown sources \['zz'\]"),
        (SRC, [AnnealingPhase(3, {"a": 0.0})], 1.0, r"are all zero"),
        (SRC, [AnnealingPhase(3), AnnealingPhase(3)], 1.0, r"two annealing phases start at the same step"),
        (SRC, [], 0.0, r"temperature=0.0 must be > 0"),
    ],
)
def test_bad_mixtures_are_refused(sources, phases, temperature, match):
    with pytest.raises(ValueError, match=match):
        MixtureSchedule(sources, phases, temperature)
    with pytest.raises(ValueError, match=r"weight=-1.0 must be >= 0"):
        MixtureSource("x", "-", -1.0)
    with pytest.raises(ValueError, match=r"lr_scale=0 must be > 0"):
        AnnealingPhase(1, lr_scale=0)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    text = SHAKESPEARE.read_text()
    dirs = []
    for i, (a, b) in enumerate([(0, 40_000), (40_000, 60_000)]):
        (root / f"{i}.txt").write_text(text[a:b])
        prepare_data(str(root / f"{i}.txt"), str(GPT2_TOKENIZER), str(root / f"tok{i}"), progress=False)
        dirs.append(str(root / f"tok{i}"))
    return [MixtureSource("plays", dirs[0], 3.0), MixtureSource("sonnets", dirs[1], 1.0)]


def _module(sources, workers=0):
    dm = MixtureDataModule(sources, seq_len=32, micro_batch_size=4, val_fraction=0.1, num_workers=workers, data_seed=7,
                           phases=[AnnealingPhase(start_step=6, weights={"sonnets": 1.0}, lr_scale=0.3)])  # fmt: skip
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resume_replays_exactly_before_and_after_the_switch(two_sources, workers):
    straight = [b for _, b in zip(range(12), _module(two_sources, workers).train_dataloader(), strict=False)]
    assert {int(s) for b in straight[:6] for s in b["source"]} == {0, 1}
    assert {int(s) for b in straight[6:] for s in b["source"]} == {1}  # the annealing phase from step 6
    # Resume at batch 3 (before the switch), then from that resumed loader again at batch 9 (after it).
    state, done = None, 0
    for cut in (3, 9):
        loader = _module(two_sources, workers).train_dataloader()
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        for _ in range(cut - done):
            next(it)
        state, done = loader.state_dict(), cut
        resumed = _module(two_sources, workers).train_dataloader()
        resumed.load_state_dict(state)
        again = [b for _, b in zip(range(12 - cut), resumed, strict=False)]
        for a, b in zip(straight[cut:], again, strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["source"], b["source"])


def test_mixture_trains_through_the_module_with_the_phase_lr(two_sources):
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=50257, max_seq_len=32, multiple_of=16)
    module = CausalLM(cfg, scheduler=SchedulerConfig(warmup_steps=0, decay="constant"))
    lrs = []

    class Lr(__import__("lightning").pytorch.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[Lr()])  # fmt: skip
    trainer.fit(module, datamodule=_module(two_sources))
    assert lrs[:6] == [3e-4] * 6 and lrs[6:] == pytest.approx([0.3 * 3e-4] * 2)


def test_checkpoint_resume_before_and_after_the_switch_gives_identical_losses(two_sources, tmp_path):
    """Through KempnerStrategy's DCP checkpoints: the data position and the phase's LR scale replay exactly."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from kempnerforge.strategies import KempnerStrategy

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=50257, max_seq_len=32, multiple_of=16)

    def run(steps, resume=None):
        losses = []

        class Rec(__import__("lightning").pytorch.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(trainer.callback_metrics["train/loss"]))

        dm = MixtureDataModule(two_sources, seq_len=32, micro_batch_size=4, val_fraction=0.1, data_seed=7,
                               phases=[AnnealingPhase(start_step=4, weights={"sonnets": 1.0}, lr_scale=0.3)])  # fmt: skip
        ckpt = ModelCheckpoint(
            dirpath=tmp_path, filename="s{step}", auto_insert_metric_name=False, every_n_train_steps=2, save_top_k=-1
        )
        trainer = Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), max_steps=steps, logger=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                          callbacks=[Rec(), ckpt])  # fmt: skip
        module = CausalLM(cfg, scheduler=SchedulerConfig(warmup_steps=1, decay="cosine", total_steps=20))
        trainer.fit(module, datamodule=dm, ckpt_path=resume)
        return losses

    straight = run(7)
    assert run(7, str(tmp_path / "s2.ckpt")) == straight[2:]  # resumed before the switch at step 4
    assert run(7, str(tmp_path / "s6.ckpt")) == straight[6:]  # and after it
