"""lm-evaluation-harness on a checkpoint (optional: skipped without ``lm_eval``): a tiny local
loglikelihood task, scored by the harness, equals the log-likelihoods computed with our model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kempnerforge.checkpoint.convert import write_weights_checkpoint
from kempnerforge.checkpoint.load import build_model, load_checkpoint_model
from tests.ops_helpers import tiny_config

pytest.importorskip("lm_eval.models.huggingface", reason="lm-evaluation-harness not installed (pip install lm_eval)")

DOCS = [
    {"context": "ROMEO: But soft, what light", "continuation": " through yonder window breaks?"},
    {"context": "First Citizen: Before we proceed", "continuation": " any further, hear me speak."},
    {"context": "To be, or not to be:", "continuation": " that is the question."},
]


def test_lm_eval_loglikelihood_task_matches_our_model(tmp_path, gpt2_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the task's data is a local file; nothing may be fetched
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # An earlier in-process Trainer leaves LOCAL_RANK & co. set; accelerate (inside HFLM) would then
    # try to join a process group. lm_eval runs in a fresh process in real use.
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from kempnerforge.tools.lm_eval_adapter import checkpoint_lm

    cfg = tiny_config("tied")
    model = build_model(cfg)
    model.init_weights(seed=2)
    write_weights_checkpoint(model, cfg, tmp_path / "ckpt", "step=0.ckpt", source="test")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kforge_tiny.yaml").write_text(
        f"task: kforge_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n"
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
    )
    lm = checkpoint_lm(tmp_path / "ckpt", tmp_path / "hf", tokenizer=gpt2_tokenizer_dir, batch_size=2)
    results = simple_evaluate(model=lm, tasks=["kforge_tiny"], task_manager=TaskManager(include_path=str(tasks)))
    ppl = results["results"]["kforge_tiny"]["perplexity,none"]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir, local_files_only=True)
    ours = load_checkpoint_model(tmp_path / "ckpt").model
    lls = []
    for doc in DOCS:
        ctx = tok.encode(doc["context"])
        whole = tok.encode(doc["context"] + doc["continuation"])
        with torch.no_grad():
            logp = ours(torch.tensor([whole[:-1]]))[0].log_softmax(-1)
        lls.append(sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole))))
    assert ppl == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)
