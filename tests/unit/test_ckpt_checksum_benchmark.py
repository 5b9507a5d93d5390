"""benchmarks/ckpt_checksum.py runs at a tiny shape: both variants round-trip the same tensors (the benchmark asserts
it) and it writes every figure the README quotes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tiny_run_writes_its_figures(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import ckpt_checksum

    out = tmp_path / "ck.json"
    result = ckpt_checksum.main(
        ["--mib", "4", "--tensors", "4", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]
    )
    assert json.loads(out.read_text()) == result
    for key in ("save_plain", "save_checksums", "load_plain", "load_checksums", "hash_gb_per_s"):
        assert result[key] > 0, key
    for op in ("save", "load"):  # the ratio of the unrounded seconds
        assert (
            abs(result[f"{op}_ratio"] - result[f"{op}_checksums"] / result[f"{op}_plain"])
            < 0.05 * result[f"{op}_ratio"]
        )
    assert result["algorithm"] == "xxh3_64"
    sys.modules.pop("ckpt_checksum", None)
