"""Streaming HF data on 2 data-parallel ranks (FSDP2, gloo): each rank reads its own rows, and a run resumed
from a DCP checkpoint (per-dp-rank loader state, packing buffer included) sees exactly the batches of the
uninterrupted run on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import train

pytestmark = pytest.mark.distributed

SHAKESPEARE = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare" / "input.txt"


def _batches(folder: Path) -> list[list]:
    return [json.loads((folder / f"rank{r}.json").read_text())["batches"] for r in range(2)]


def test_streaming_resume_per_rank_is_exact(shakespeare_tokens, tmp_path):
    docs = tmp_path / "docs.jsonl"
    paragraphs = [p for p in SHAKESPEARE.read_text()[:40_000].split("\n\n") if p.strip()]
    docs.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    common = ("--stream-jsonl", str(docs), "--micro-batch", "2", "--steps", "8")
    (tmp_path / "straight").mkdir()
    (tmp_path / "resumed").mkdir()
    ckpt = tmp_path / "ckpt"
    straight = train(2, shakespeare_tokens, tmp_path / "s.json", *common, "--ckpt-dir", str(ckpt),
                     "--ckpt-every", "4", "--record-batches", str(tmp_path / "straight"))  # fmt: skip
    resumed = train(2, shakespeare_tokens, tmp_path / "r.json", *common, "--resume", str(ckpt / "step=0004.ckpt"),
                    "--record-batches", str(tmp_path / "resumed"))  # fmt: skip
    full, tail = _batches(tmp_path / "straight"), _batches(tmp_path / "resumed")
    assert full[0] != full[1]  # the ranks read different rows
    assert [b[4:] for b in full] == tail and len(tail[0]) == 4
    assert resumed["losses"] == pytest.approx(straight["losses"][4:], rel=1e-5)
