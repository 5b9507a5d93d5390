"""Pipeline parallelism with MoE models and tied embeddings on gloo equals one process (issue 19, check 6).

Two launches (``pp_script.py``, several ``Trainer.fit`` runs each): 2 processes at pp=2 (the MoE decoder
with 1F1B and a checkpoint at step 3, with interleaved 1F1B and full activation checkpointing; the tied
decoder with 1F1B and with interleaved 1F1B), then 1 process (the MoE and tied oracles, and the pp=2 MoE
checkpoint resumed at pp=1). Global batch 8 sequences of 32 tokens, 5 steps, 4 layers, fp32. The MoE
decoder (``pp_script.moe_config``) has one MoE block per stage with sequence-wise aux and z losses and the
aux-loss-free router bias: the aux losses of both stages and both routers' bias updates must reach the
step exactly as in one process.
"""

from __future__ import annotations

import pytest

from tests.distributed.launch import HERE, launch_runs

pytestmark = pytest.mark.distributed

SCRIPT = HERE / "pp_script.py"
PP2_RUNS = [
    "moe:pp=2,moe=1,mb=2,ckpt_every=3",
    "moe_ac:pp=2,moe=1,mb=4,ac=full",  # every micro-batch's forward before the first recompute
    "moe_interleaved_ac:pp=2,moe=1,schedule=interleaved_1f1b,v=2,mb=4,ac=full",
    "tie:pp=2,tie=1,mb=2,ckpt_every=3",
    "tie_interleaved:pp=2,tie=1,schedule=interleaved_1f1b,v=2,mb=2",
]
SINGLE_RUNS = [
    "moe_single:moe=1",
    "moe_to_pp1:moe=1,resume=moe/step=0003.ckpt",
    "tie_single:tie=1",
    "tie_to_pp1:tie=1,resume=tie/step=0003.ckpt",
]


def _launch(nproc: int, data, root, runs: list[str]) -> dict:
    return launch_runs(nproc, SCRIPT, data, root, runs, ckpt_root=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pp_moe_tied")


@pytest.fixture(scope="module")
def pp2(shakespeare_tokens, root):
    return _launch(2, shakespeare_tokens, root, PP2_RUNS)


@pytest.fixture(scope="module")
def single(shakespeare_tokens, root, pp2):
    """The one-process oracles, and pp=2's MoE step-3 checkpoint resumed at pp=1 (after ``pp2`` saved it)."""
    return _launch(1, shakespeare_tokens, root, SINGLE_RUNS)


def _assert_close(record: dict, oracle: dict, first_step: int = 1) -> None:
    assert record["steps"] == oracle["steps"][first_step - 1 :]
    for a, b in zip(record["losses"], oracle["losses"][first_step - 1 :], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    for a, b in zip(record["grad_norms"], oracle["grad_norms"][first_step - 1 :], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("run", ["moe", "moe_ac", "moe_interleaved_ac"])
def test_pp2_moe_matches_single_process(pp2, single, run):
    """5 steps of the MoE decoder at pp=2: losses and grad norms within 1e-5 of one process; the loss moves."""
    _assert_close(pp2[run], single["moe_single"])
    assert single["moe_single"]["losses"][-1] < single["moe_single"]["losses"][0] - 0.3


@pytest.mark.parametrize("run", ["tie", "tie_interleaved"])
def test_pp2_tied_embeddings_match_single_process(pp2, single, run):
    """Tied embedding on the first stage, its copy under the head on the last: one logical weight."""
    _assert_close(pp2[run], single["tie_single"])
    assert single["tie_single"]["losses"][-1] < single["tie_single"]["losses"][0] - 0.3


def test_pp2_moe_and_tied_checkpoints_resume_at_pp1(single):
    """The pp=2 MoE checkpoint (experts, router biases, Adam moments under full-model FQNs) and the tied one,
    resumed by one process, continue the uninterrupted one-process runs at steps 4-5."""
    _assert_close(single["moe_to_pp1"], single["moe_single"], first_step=4)
    _assert_close(single["tie_to_pp1"], single["tie_single"], first_step=4)


def test_pp2_tied_checkpoint_holds_one_embedding(pp2, root):
    """The tied weight is written once under its canonical FQN (both stages hold it; DCP keeps one copy), with
    the keys of a one-process tied checkpoint: the model state's two aliases (``tok_embeddings.weight``,
    ``output.weight``) and one optimizer state, under the embedding's name."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(root / "tie" / "step=0003.ckpt")).read_metadata()
    for alias in ("tok_embeddings.weight", "output.weight"):
        writes = [i for i in meta.storage_data if i.fqn == f"state_dict.model.{alias}"]
        assert len(writes) == 1, writes
    state = {
        k for k in meta.state_dict_metadata if k.startswith("optimizer_0.state.") and ("tok_" in k or "output" in k)
    }
    assert state == {f"optimizer_0.state.model.tok_embeddings.weight.{m}" for m in ("exp_avg", "exp_avg_sq", "step")}
