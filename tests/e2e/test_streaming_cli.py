"""Issue 30 check 3: ``kforge fit --data.class_path kempnerforge.data.StreamingTokenDataModule`` trains from the CLI
on a mixture of a jsonl file and a folder of parquet files (2 processes, 1 dataloader worker each), is stopped by
SIGTERM to its process group mid-run, and the same command resumes it: every step's loss equals an uninterrupted
run's (1e-6), so the streams' positions, packing buffers and the mixture's draw counter were restored exactly.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.preempt_helpers import REPO
from tests.e2e.recipe_kills import kill_recipe, log_tail


def _sources(root):
    import pyarrow as pa
    import pyarrow.parquet as pq

    paragraphs = [p for p in (REPO / "data" / "tinyshakespeare" / "input.txt").read_text()[:80_000].split("\n\n") if p]
    root.mkdir()
    (root / "a.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[:200]))
    (root / "b").mkdir()
    for i in range(2):  # 2 files: one per data-parallel rank
        rows = [{"text": p} for p in paragraphs[200 + 100 * i : 300 + 100 * i]]
        pq.write_table(pa.Table.from_pylist(rows), root / "b" / f"{i}.parquet")
    return [{"name": "jsonl", "source": str(root / "a.jsonl"), "weight": 2.0},
            {"name": "parquet", "source": str(root / "b"), "weight": 1.0}]  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_streaming_mixture_from_the_cli_is_killed_and_resumes_exactly(tmp_path):
    data = {
        "class_path": "kempnerforge.data.StreamingTokenDataModule",
        "init_args": {"sources": _sources(tmp_path / "src"), "tokenizer": str(REPO / "data" / "tokenizers" / "gpt2"),
                      "seq_len": 32, "micro_batch_size": 2, "num_workers": 1, "data_seed": 3},
    }  # fmt: skip
    result = kill_recipe(tmp_path / "run", "debug", steps=6, kills=1, data=data, seed=0)
    print(result)
    assert result.codes[:-1] == [75] and result.codes[-1] == 0, (result, log_tail(tmp_path / "run"))
    assert 0 < result.stopped_at[0] < 6 and max(result.exit_s) < 30, result
    assert result.max_loss_diff <= 1e-6, (result, log_tail(tmp_path / "run"))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"seq_len": 0}, "kforge: error: data.seq_len: data.seq_len=0 must be a positive integer"),
        (
            {"source": "/nonexistent/corpus.jsonl"},
            "kforge: error: data.source: '/nonexistent/corpus.jsonl' does not exist",
        ),
        (
            {"text_field": "body"},
            "kforge: error: data.text_field: text_field='body' is not a text column of data.source",
        ),
        (
            {"max_steps": -1},
            "kforge: error: trainer.max_steps: must be a positive integer with StreamingTokenDataModule",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore")
def test_streaming_settings_are_refused_before_any_process_starts(override, expected, tmp_path):
    """A bad streaming setting is one line naming the field, exit 2, from the preflight (before the rendezvous)."""
    import yaml

    from tests.e2e.inprocess import kforge_in_process

    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "To be, or not to be"}) + "\n")
    cfg = yaml.safe_load((REPO / "configs" / "debug.yaml").read_text())
    args = {"source": str(tmp_path / "a.jsonl"), "tokenizer": str(REPO / "data" / "tokenizers" / "gpt2"), "seq_len": 32}
    args.update({k: v for k, v in override.items() if k != "max_steps"})
    cfg["data"] = {"class_path": "kempnerforge.data.StreamingTokenDataModule", "init_args": args}
    cfg["trainer"].update(logger=False, max_steps=override.get("max_steps", 2))
    cfg["trainer"]["callbacks"][-1]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    proc = kforge_in_process("fit", "--config", str(tmp_path / "cfg.yaml"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith(expected), line
    assert not (tmp_path / "ckpt").exists()
