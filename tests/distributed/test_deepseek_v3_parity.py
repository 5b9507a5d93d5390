"""Issue 20 check 2 for DeepSeek-V3: an imported ``DeepseekV3ForCausalLM`` (tests/deepseek_tiny.py: MLA with a query
latent, 1 dense + 2 group-limited sigmoid MoE layers, a shared expert) trains 5 steps under ``dp_shard=2`` (FSDP2,
also with full AC), ``tp=2`` (heads and experts' hidden channels split, also with sequence parallel + full AC),
``pp=2`` (1F1B) and ``ep=2`` (experts split, token all-to-all) equal to one process.

One 2-process launch of ``deepseek_script.py`` holds the six distributed runs; the one-process oracle runs in
this process (the same ``run``, ``devices=1``). Its first loss equals HF's loss on the same batch (the run starts
from the imported weights), losses and grad norms match within 1e-5 relative, and under TP the per-head
projections really are split while the latent projections and norms stay whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kempnerforge.checkpoint.convert import hf_to_dcp
from kempnerforge.data.prepare import prepare_data
from tests.deepseek_tiny import SHAKESPEARE, save_tiny_deepseek_v3
from tests.distributed import deepseek_script
from tests.distributed.launch import HERE, launch_runs

pytestmark = pytest.mark.distributed

RUNS = {
    "dp2": "micro_batch=4",
    "dp2_ac": "micro_batch=4,ac=full",
    "tp2": "tp=2",
    "tp2_sp_ac": "tp=2,sp=1,ac=full",
    "pp2": "pp=2",
    "ep2": "ep=2,micro_batch=4",
}
PER_HEAD = ("wq_b.weight", "wkv_b.weight", "wo.weight")
LATENT = ("wq_a.weight", "q_norm.weight", "wkv_a.weight", "kv_norm.weight")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(hf_dir, imported checkpoint, character-level token data)."""
    root = tmp_path_factory.mktemp("deepseek_parity")
    hf_dir = save_tiny_deepseek_v3(root / "hf")
    imported = hf_to_dcp(hf_dir, root / "imported")
    (root / "text.txt").write_text(SHAKESPEARE.read_text()[:60_000])
    data = root / "tokens"
    prepare_data(source=str(root / "text.txt"), tokenizer=str(hf_dir), output_dir=str(data), progress=False)
    return hf_dir, imported, data, root


@pytest.fixture(scope="module")
def single(setup):
    _, imported, data, _ = setup
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return deepseek_script.run({"ckpt": str(imported)}, str(data))
    finally:
        torch.use_deterministic_algorithms(deterministic)
        if dist.is_initialized():  # the strategy's 1-rank group
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def two(setup):
    _, imported, data, root = setup
    specs = [f"{name}:{opts},ckpt={imported}" for name, opts in RUNS.items()]
    return launch_runs(2, HERE / "deepseek_script.py", data, root, specs, timeout=400, tag="deepseek")


def test_one_process_starts_from_the_imported_weights(setup, single):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(setup[0], dtype=torch.float32, local_files_only=True)
    ids, labels = (torch.tensor(single["first_batch"][k]) for k in ("input_ids", "labels"))
    with torch.no_grad():
        logits = hf.eval()(input_ids=ids).logits
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert single["losses"][0] == pytest.approx(float(expected), rel=1e-5)
    assert single["losses"][-1] < single["losses"][0] - 0.2  # the oracle really trains


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_equal_one(two, single, name):
    record = two[name]
    assert len(record["losses"]) == len(single["losses"]) == 5
    for a, b in zip(record["losses"], single["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5), (record["losses"], single["losses"])
    for a, b in zip(record["grad_norms"], single["grad_norms"], strict=True):
        assert a == pytest.approx(b, rel=1e-5), (record["grad_norms"], single["grad_norms"])
    numel = record["numel"]
    if name.startswith("pp"):  # stage 0 (rank 0) holds blocks 0-1 whole
        assert all(numel[p][0] == numel[p][1] for p in PER_HEAD + LATENT), numel
    elif name.startswith("tp"):  # heads split over TP, the latents replicated
        assert all(numel[p][0] * 2 == numel[p][1] for p in PER_HEAD), numel
        assert all(numel[p][0] == numel[p][1] for p in LATENT), numel
    else:  # FSDP2 shards everything over dp_shard (ep=2 borrows its ranks; attention stays FSDP2-sharded)
        assert all(numel[p][0] * 2 == numel[p][1] for p in PER_HEAD + LATENT), numel
