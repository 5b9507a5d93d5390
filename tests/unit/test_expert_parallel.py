"""The EP step: its place in the chain, a no-op without MoE at ep=1, never a silent no-op at ep>1."""

from __future__ import annotations

import pytest

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.parallel.expert_parallel import apply_ep, moe_layers
from kempnerforge.parallel.order import TransformOrderError, applied_steps, record_step

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=16, multiple_of=16)


class _Mesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_ep1_records_only():
    model = Transformer(CFG)
    before = [(n, p) for n, p in model.named_parameters()]
    apply_ep(model, None)
    apply_ep(Transformer(CFG), _Mesh(1))
    assert applied_steps(model) == ["ep"]
    assert [(n, p) for n, p in model.named_parameters()] == before
    assert moe_layers(model) == []


def test_ep_after_tp_ok_and_before_tp_raises():
    model = Transformer(CFG)
    record_step(model, "tp")
    apply_ep(model, None)
    other = Transformer(CFG)
    apply_ep(other, None)
    with pytest.raises(TransformOrderError, match="Cannot apply 'tp' after 'ep'"):
        record_step(other, "tp")


def test_ep_after_float8_raises():
    model = Transformer(CFG)
    record_step(model, "float8")
    with pytest.raises(TransformOrderError, match="Cannot apply 'ep' after 'float8'"):
        apply_ep(model, None)


def test_ep_gt_1_without_moe_raises():
    with pytest.raises(ValueError) as err:
        apply_ep(Transformer(CFG), _Mesh(2))
    assert str(err.value) == "ep=2 needs MoE layers, but the model has none; use ep=1."


def test_validate_ep_names_the_fields():
    from kempnerforge.parallel.expert_parallel import validate_ep

    validate_ep(2, 8)
    validate_ep(1, 0)
    with pytest.raises(ValueError, match=r"num_experts=6 must be divisible by ep=4; allowed ep: \[1, 2, 3, 6\]"):
        validate_ep(4, 6)
    with pytest.raises(ValueError, match="ep=2 needs MoE layers"):
        validate_ep(2, 0)
