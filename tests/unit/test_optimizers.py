"""Optimizers by name: parameter routing, equality with the libraries they wrap, validation messages."""

from __future__ import annotations

import copy

import pytest
import torch

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.module import CausalLM
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import (
    MuonWithAdamW,
    OptimizerConfig,
    build_optimizer,
    muon_param_ids,
    set_schedule_free_mode,
)

# Separate projections: Muon orthogonalizes each matrix and refuses the default fused wqkv / w13.
CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=16, multiple_of=16,
                  fuse_qkv=False, fuse_w13=False)  # fmt: skip


def _model(cfg: ModelConfig = CFG) -> Transformer:
    m = Transformer(cfg)
    m.init_weights(seed=0)
    return m


def _step(model: Transformer, opt: torch.optim.Optimizer, seed: int) -> None:
    tokens = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(tokens).square().mean().backward()
    opt.step()


def test_muon_takes_hidden_matrices_only():
    model = _model()
    names = {n for n, p in model.named_parameters() if id(p) in muon_param_ids(model)}
    assert names == {f"layers.{i}.{m}.weight" for i in range(2) for m in
                     ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                      "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}  # fmt: skip
    model.layers["0"].attention.wq.weight.requires_grad_(False)  # frozen: in no group at all
    opt = build_optimizer(model, OptimizerConfig(name="muon"))
    in_groups = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model.layers["0"].attention.wq.weight) not in in_groups
    assert len(in_groups) == sum(1 for p in model.parameters() if p.requires_grad)


def test_muon_with_adamw_equals_the_two_torch_optimizers_and_reloads():
    """Oracle: torch.optim.Muon on the matrices + torch.optim.AdamW on the rest, stepped separately."""
    cfg = OptimizerConfig(name="muon", lr=1e-2, weight_decay=0.1)
    a, b = _model(), _model()
    ours = build_optimizer(a, cfg)
    assert isinstance(ours, MuonWithAdamW)
    ids = muon_param_ids(b)
    groups = {True: [], False: []}
    for g in ours.param_groups:  # same grouping, applied to model b's parameters by position
        pos = {id(p): i for i, p in enumerate(a.parameters())}
        bp = list(b.parameters())
        groups[g["muon"]].append({"params": [bp[pos[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]})
    assert all(id(p) in ids for g in groups[True] for p in g["params"])
    muon = torch.optim.Muon(groups[True], lr=1e-2, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(groups[False], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for seed in range(3):
        _step(a, ours, seed)
        tokens = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
        muon.zero_grad(), adamw.zero_grad()
        b(tokens).square().mean().backward()
        muon.step(), adamw.step()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    # state_dict -> fresh optimizer: the inner optimizers see the loaded state and continue identically
    c = copy.deepcopy(a)
    reloaded = build_optimizer(c, cfg)
    reloaded.load_state_dict(copy.deepcopy(ours.state_dict()))
    _step(a, ours, 7), _step(c, reloaded, 7)
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["lion", "schedule_free_adamw", "adamw"])
def test_each_optimizer_lowers_a_loss(name):
    model = _model()
    opt = build_optimizer(model, OptimizerConfig(name=name, lr=3e-3))
    tokens = torch.randint(0, CFG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_schedule_free_eval_swaps_in_the_average_and_train_restores():
    model = _model()
    opt = build_optimizer(model, OptimizerConfig(name="schedule_free_adamw", lr=1e-2))
    assert not opt.state  # no empty entries left by train(): DCP's loader would skip the state
    _step(model, opt, 0), _step(model, opt, 1)
    y = model.output.weight.detach().clone()
    set_schedule_free_mode(opt, train=False)
    assert not torch.equal(model.output.weight, y)  # x (the average) differs from y
    set_schedule_free_mode(opt, train=True)
    torch.testing.assert_close(model.output.weight, y, rtol=1e-6, atol=1e-7)
    set_schedule_free_mode(torch.optim.SGD(model.parameters(), lr=0.1), train=False)  # others: no-op


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"name": "sgd"}, r"optimizer.name='sgd' is not allowed; choose one of \['adamw', 'muon', 'lion'"),
        ({"muon_adjust_lr": "x"}, r"optimizer.muon_adjust_lr='x'; choose one of"),
        ({"muon_momentum": 1.0}, r"optimizer.muon_momentum=1.0 must be in \[0, 1\)"),
        ({"muon_ns_steps": 0}, r"optimizer.muon_ns_steps=0 must be in \[1, 100\)"),
        ({"name": "lion", "fused": True}, r"optimizer.fused=True applies to adamw only"),
        ({"lr": 0.0}, r"optimizer.lr=0.0 must be > 0"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)


def test_schedule_free_refuses_a_decaying_schedule():
    with pytest.raises(ValueError, match=r"schedule_free_adamw' needs scheduler.decay 'constant' or 'none'"):
        CausalLM(CFG, optimizer=OptimizerConfig(name="schedule_free_adamw"), scheduler=SchedulerConfig(decay="cosine"))
    CausalLM(CFG, optimizer=OptimizerConfig(name="schedule_free_adamw"), scheduler=SchedulerConfig(decay="constant"))


def _tp_like_model() -> Transformer:
    """The tiny model with its Linear and embedding weights as DTensors (1-rank mesh) and the norms plain: the
    parameter mix tensor parallelism without FSDP2 leaves (norms outside the TP plan, no sequence parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model = _model()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear | torch.nn.Embedding):
            m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Replicate()]))
    return model


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_plain_and_dtensor_parameters_get_separate_groups_so_fused_kernels_run(gloo_world_1, kernel):
    from torch.distributed.tensor import DTensor

    model = _tp_like_model()
    opt = build_optimizer(model, OptimizerConfig(**{kernel: True}))
    kinds = [({isinstance(p, DTensor) for p in g["params"]}, g["weight_decay"]) for g in opt.param_groups]
    assert kinds == [({True}, 0.1), ({False}, 0.0), ({True}, 0.0)]  # decay: matrices; no decay: norms, embedding
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # one mixed group used to fail: "got mixed torch.Tensor and DTensor"
    with pytest.raises(ValueError, match="exclude each other"):
        OptimizerConfig(fused=True, foreach=True)
    with pytest.raises(ValueError, match=r"optimizer.foreach=True applies to adamw only"):
        OptimizerConfig(name="lion", foreach=True)


def test_lr_schedule_resumes_across_a_change_in_the_number_of_param_groups(gloo_world_1):
    """A checkpoint written under one mesh (2 groups, all plain) resumes under another (more groups): one curve."""
    from kempnerforge.training.lr import build_scheduler

    cfg = SchedulerConfig(warmup_steps=2, total_steps=10)
    a_opt = build_optimizer(_model(), OptimizerConfig())
    a = build_scheduler(a_opt, cfg, 10)
    for _ in range(4):
        a_opt.step()
        a.step()
    b_opt = build_optimizer(_tp_like_model(), OptimizerConfig())
    assert len(b_opt.param_groups) > len(a_opt.param_groups)
    b = build_scheduler(b_opt, cfg, 10)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        a_opt.step(), a.step(), b_opt.step(), b.step()
        assert b.get_last_lr() == [a.get_last_lr()[0]] * len(b_opt.param_groups)
    state = a.state_dict()
    state["base_lrs"] = [1e-3, 2e-3]
    with pytest.raises(ValueError, match="cannot be matched"):
        build_scheduler(b_opt, cfg, 10).load_state_dict(state)
