"""Issue 26 checks 1, 2 and 4: context parallelism (``cp > 1``, ``cp_attention=allgather``) equals one process.

Three launches of ``cp_script.py`` (the tiny decoder of ``train_script``, 5 steps on a global batch of 8 x 32
tokens, fp32 on gloo):

- 2 processes, cp=2: plain; packed documents (1-2 lines of real text per document, so document boundaries fall
  inside the 8-token zigzag chunks); full AC; per-block compile (``aot_eager``); the tiny MoE (ep=1, and ep=2 over
  the cp ranks); MLA; and a 6-step run that saves at step 3.
- 1 process: the oracles of each, and the cp=2 step-3 checkpoint resumed at cp=1.
- 4 processes: cp=4 (plain, packed documents), cp=2 x tp=2 with sequence parallel, cp=2 x dp_shard=2, HSDP
  (dp_replicate=2 x cp=2), the MoE with ep=2 over dp_shard x cp and with HSDP, cp=2 x pp=2 (dense and MoE), and
  the cp=2 checkpoint resumed at cp=4.

Losses and grad norms within 1e-5 relative of one process; the resumed runs continue with the uninterrupted run's
values; ``tokens_seen`` counts every token once whatever cp is.
"""

from __future__ import annotations

import json

import pytest

from kempnerforge.data.prepare import prepare_data
from tests.conftest import GPT2_TOKENIZER, SHAKESPEARE
from tests.distributed.launch import HERE, launch

pytestmark = pytest.mark.distributed

SCRIPT = HERE / "cp_script.py"
TOL = 1e-5
TWO = {
    "plain": "cp=2",
    "docs": "cp=2,docs=1",
    "ac_full": "cp=2,ac=full",
    "compile": "cp=2,compile=1",
    "moe": "cp=2,moe=1",
    "moe_ep2": "cp=2,moe=1,ep=2",
    "mla": "cp=2,mla=1",
    "save": "cp=2,steps=6,save=3",
}
ONE = {
    "plain": "",
    "docs": "docs=1",
    "moe": "moe=1",
    "mla": "mla=1",
    "plain6": "steps=6",
    "resumed_cp1": "steps=6,resume=save,resume_step=3",
}
FOUR = {
    "cp4": "cp=4",
    "cp4_docs": "cp=4,docs=1",
    "cp2_tp2_sp": "cp=2,tp=2,sp=1",
    "cp2_dp_shard2": "cp=2,dp_shard=2",
    "hsdp_cp2": "cp=2,dp_replicate=2",
    "cp2_dp_shard2_ep2": "cp=2,dp_shard=2,moe=1,ep=2",
    "hsdp_cp2_ep2": "cp=2,dp_replicate=2,moe=1,ep=2",
    "cp2_pp2": "cp=2,pp=2",
    "cp2_pp2_moe": "cp=2,pp=2,moe=1",
    "resumed_cp4": "cp=4,steps=6,resume=save,resume_step=3",
}
#: The one-process oracle of each run (runs not listed: ``plain``).
ORACLE = {"docs": "docs", "cp4_docs": "docs", "moe": "moe", "moe_ep2": "moe", "cp2_dp_shard2_ep2": "moe",
          "hsdp_cp2_ep2": "moe", "cp2_pp2_moe": "moe", "mla": "mla", "save": "plain6"}  # fmt: skip


@pytest.fixture(scope="module")
def docs_tokens(tmp_path_factory):
    """Real text cut into 1000 documents of 2 lines each (~15 tokens: several per 32-token window)."""
    root = tmp_path_factory.mktemp("cp_docs")
    lines = SHAKESPEARE.read_text().splitlines()[:2000]
    with (root / "docs.jsonl").open("w") as f:
        for i in range(0, len(lines), 2):
            f.write(json.dumps({"text": "\n".join(lines[i : i + 2])}) + "\n")
    prepare_data(str(root / "docs.jsonl"), str(GPT2_TOKENIZER), str(root / "tok"), progress=False)
    return root / "tok"


@pytest.fixture(scope="module")
def records(shakespeare_tokens, docs_tokens, tmp_path_factory):
    """``{nproc: {run: record}}`` of the three launches (the 2-process one first: it writes the checkpoint)."""
    root = tmp_path_factory.mktemp("cp")
    out = {}
    for nproc, runs in ((2, TWO), (1, ONE), (4, FOUR)):
        path = root / f"records_{nproc}.json"
        specs = [f"{name}:{opts}" for name, opts in runs.items()]
        args = ["--data", str(shakespeare_tokens), "--docs", str(docs_tokens), "--out", str(path),
                "--ckpt-root", str(root), "--runs", *specs]  # fmt: skip
        launch(nproc, SCRIPT, args, timeout=600)
        out[nproc] = json.loads(path.read_text())
    return out


def _max_rel(got: list[float], want: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(got, want, strict=True))


@pytest.mark.parametrize(("nproc", "run"), [(2, r) for r in TWO] + [(4, r) for r in FOUR if "resumed" not in r])
def test_cp_run_equals_one_process(records, nproc, run):
    got, want = records[nproc][run], records[1][ORACLE.get(run, "plain")]
    assert got["steps"] == want["steps"]
    assert _max_rel(got["losses"], want["losses"]) <= TOL, (got["losses"], want["losses"])
    assert _max_rel(got["grad_norms"], want["grad_norms"]) <= TOL, (got["grad_norms"], want["grad_norms"])
    assert got["tokens_seen"] == want["tokens_seen"]  # each token once: 8 x 32 per step


@pytest.mark.parametrize(("nproc", "run"), [(1, "resumed_cp1"), (4, "resumed_cp4")])
def test_cp2_checkpoint_resumes_at_another_cp(records, nproc, run):
    got, want = records[nproc][run], records[1]["plain6"]
    assert got["steps"] == [4, 5, 6]
    assert _max_rel(got["losses"], want["losses"][3:]) <= TOL
    assert _max_rel(got["grad_norms"], want["grad_norms"][3:]) <= TOL
    assert got["tokens_seen"] == want["tokens_seen"]


def test_packed_documents_cross_the_cp_chunks(docs_tokens):
    """The packed-document case is a real one: most zigzag chunks (8 tokens at cp=2) hold a document boundary."""
    from kempnerforge.data.memmap import MemmapTokenDataset

    data = MemmapTokenDataset(docs_tokens, 32, document_masking=True)
    chunks = [data[i]["doc_ids"].view(4, 8) for i in range(20)]
    crossing = sum(int((c[:, 0] != c[:, -1]).sum()) for c in chunks)
    assert crossing >= 30  # of 80 chunks
