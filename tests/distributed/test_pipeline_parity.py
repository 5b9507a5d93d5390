"""Pipeline parallelism on gloo equals one process (issue 10, checks 1-3).

Three launches, several ``Trainer.fit`` runs each (``pp_script.py``): 2 processes at pp=2 (every
schedule, a checkpoint at step 3 and its resume, validation), 1 process (the oracle, and the pp=2
checkpoint resumed at pp=1: the pp-change path), 4 processes at pp=2 x dp_shard=2. Global batch 8
sequences of 32 tokens, 5 steps, the 4-layer tiny decoder, fp32.
"""

from __future__ import annotations

import pytest

from tests.distributed.launch import HERE, launch_runs

pytestmark = pytest.mark.distributed

SCRIPT = HERE / "pp_script.py"
PP2_RUNS = [
    "1f1b:pp=2,schedule=1f1b,mb=4,ckpt_every=3,val_batches=2",
    "resume:pp=2,schedule=1f1b,mb=4,resume=1f1b/step=0003.ckpt",
    "gpipe:pp=2,schedule=gpipe,mb=2,ac=full",  # per-stage activation checkpointing too
    "interleaved_1f1b:pp=2,schedule=interleaved_1f1b,v=2,mb=4",
    "zbv:pp=2,schedule=zbv,v=2,mb=4",
    "accumulate:pp=2,micro_batch=4,acc=2,mb=2",  # 2 accumulated batches of 4 = the global batch of 8
]


def _launch(nproc: int, data, root, runs: list[str]) -> dict:
    return launch_runs(nproc, SCRIPT, data, root, runs, ckpt_root=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pp")


@pytest.fixture(scope="module")
def pp2(shakespeare_tokens, root):
    return _launch(2, shakespeare_tokens, root, PP2_RUNS)


@pytest.fixture(scope="module")
def single(shakespeare_tokens, root, pp2):
    """The one-process oracle, and pp=2's step-3 checkpoint resumed at pp=1 (after ``pp2`` saved it)."""
    return _launch(1, shakespeare_tokens, root, ["single:val_batches=2", "to_pp1:resume=1f1b/step=0003.ckpt"])


def _assert_close(record: dict, oracle: dict, first_step: int = 1) -> None:
    assert record["steps"] == oracle["steps"][first_step - 1 :]
    for a, b in zip(record["losses"], oracle["losses"][first_step - 1 :], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    for a, b in zip(record["grad_norms"], oracle["grad_norms"][first_step - 1 :], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zbv", "accumulate"])
def test_pp2_schedule_matches_single_process(pp2, single, schedule):
    """Check 1: 5 steps, losses and clipped-step grad norms within 1e-5 of one process; the loss moves."""
    _assert_close(pp2[schedule], single["single"])
    assert single["single"]["losses"][-1] < single["single"]["losses"][0] - 0.3


def test_pp2_validation_loss_matches_single_process(pp2, single):
    assert pp2["1f1b"]["val_loss"] == pytest.approx(single["single"]["val_loss"], rel=1e-5)
    assert pp2["1f1b"]["val_ppl"] == pytest.approx(single["single"]["val_ppl"], rel=1e-4)


def test_pp2_resume_repeats_the_uninterrupted_run(pp2):
    """Check 3: saved at step 3 under pp=2, resumed under pp=2: identical losses for steps 4-5."""
    assert pp2["resume"]["steps"] == [4, 5]
    assert pp2["resume"]["losses"] == pp2["1f1b"]["losses"][3:]
    assert pp2["resume"]["grad_norms"] == pp2["1f1b"]["grad_norms"][3:]


def test_pp2_checkpoint_resumes_at_pp1(single):
    """Check 3, changing the pp degree: the pp=2 DCP checkpoint (full-model FQNs, flattened optimizer
    state) resumed by one process continues the one-process run."""
    _assert_close(single["to_pp1"], single["single"], first_step=4)


def test_pp2_x_dp_shard2_and_pp2_x_tp2_match_single_process(shakespeare_tokens, root, single):
    """Check 2: 4 processes, pp=2 x dp_shard=2 (FSDP2 per stage), 1F1B and interleaved, plus a resume;
    and pp=2 x tp=2 (TP per stage, logits gathered on the last stage) with validation, and with sequence
    parallelism (each stage's hidden states are this rank's share of the sequence)."""
    runs = [
        "dp_1f1b:pp=2,micro_batch=4,mb=2,ckpt_every=3",
        "dp_resume:pp=2,micro_batch=4,mb=2,resume=dp_1f1b/step=0003.ckpt",
        "dp_interleaved:pp=2,schedule=interleaved_1f1b,v=2,micro_batch=4,mb=2",
        "tp:pp=2,tp=2,mb=4,val_batches=2",
        "tp_sp:pp=2,tp=2,sp=1,mb=4",  # sequence parallelism: RoPE spans the whole sequence at every stage
    ]
    records = _launch(4, shakespeare_tokens, root, runs)
    _assert_close(records["dp_1f1b"], single["single"])
    _assert_close(records["dp_interleaved"], single["single"])
    assert records["dp_resume"]["losses"] == records["dp_1f1b"]["losses"][3:]
    _assert_close(records["tp"], single["single"])
    assert records["tp"]["val_loss"] == pytest.approx(single["single"]["val_loss"], rel=1e-5)
    _assert_close(records["tp_sp"], single["single"])


def test_pp2_checkpoint_consolidates_to_a_full_hf_model(pp2, root, tmp_path):
    """The documented export: a pp=2 DCP checkpoint -> one full state dict -> HF LlamaForCausalLM, equal logits."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import LlamaForCausalLM

    from kempnerforge.checkpoint.hf_llama import to_hf_config, to_hf_state_dict
    from kempnerforge.model import Transformer
    from tests.distributed.train_script import tiny_config

    dcp_to_torch_save(root / "1f1b" / "step=0003.ckpt", tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)["state_dict"]
    model_state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    cfg = dataclasses.replace(tiny_config(), n_layers=4)
    model = Transformer(cfg)
    model.load_state_dict(model_state, strict=True)
    hf = LlamaForCausalLM._from_config(to_hf_config(cfg), attn_implementation="eager").eval()
    hf.load_state_dict(to_hf_state_dict(model_state, cfg), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)
