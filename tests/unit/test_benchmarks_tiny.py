"""Every benchmark without a test of its own runs at a tiny shape and writes figures that mean something: the
variants of one model train to the same losses where they must (fusing projections and the loss paths change no
number beyond rounding), each ratio is finite and positive, and the JSON holds what the README quotes from it.
The figures themselves are not asserted (2 shared cores): the benchmarks report them, side by side, in one run."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.procs import run_group

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


#: The scripts, by the name each test uses.
SCRIPTS = {
    "fused_projections": "benchmarks/fused_projections.py",
    "loss_path": "benchmarks/loss_path.py",
    "moe_step": "benchmarks/moe_step.py",
    "init_time": "benchmarks/init_time.py",
    "compile_parts": "benchmarks/compile_parts.py",
    "chunked_ce_memory": "benchmarks/chunked_ce_memory.py",
    "startup": "benchmarks/startup.py",
    "data_io": "benchmarks/data_io.py",
    "checkpoint_io": "benchmarks/checkpoint_io.py",
    "replica_groups": "benchmarks/replica_groups.py",
}
#: Every file of benchmarks/ and the test that runs it at a tiny shape (issue 29: none may break unnoticed).
RUN_BY = {
    **{path: "tests/unit/test_benchmarks_tiny.py" for path in SCRIPTS.values()},
    "benchmarks/cpu_throughput.py": "tests/unit/test_cpu_throughput_benchmark.py",
    "benchmarks/ckpt_checksum.py": "tests/unit/test_ckpt_checksum_benchmark.py",
    "benchmarks/cp_step.py": "tests/unit/test_cp_step_benchmark.py",
    # every row at its published (cluster) shape: simulated, about 25 s
    "benchmarks/estimate_published.py": "tests/e2e/test_estimate_published.py",
    "benchmarks/gpu_mfu.py": "tests/unit/test_gpu_mfu_benchmark.py",
    "benchmarks/gpu_check.sh": "tests/unit/test_gpu_mfu_benchmark.py",
    # the contenders' builders, imported by gpu_mfu.py (torchtitan's side where torchtitan imports)
    "benchmarks/contenders.py": "tests/unit/test_gpu_mfu_benchmark.py",
}


def _run(script: str, *args: str, tmp: Path, codes: tuple[int, ...] = (0,)) -> dict:
    out = tmp / f"{script}.json"
    cmd = [sys.executable, str(REPO / SCRIPTS[script]), *args, "--json", str(out)]
    proc = run_group(cmd, cwd=tmp, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode in codes, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_fused_projections_variants_train_alike(tmp_path):
    tiny = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--vocab", "256", "--seq", "16", "--batch", "2"]
    result = _run("fused_projections", *tiny, "--warmup", "1", "--steps", "3", tmp=tmp_path)
    assert set(result["variants"]) == {"unfused", "qkv", "w13", "both"} and result["steps"] == 3
    for name, row in result["variants"].items():
        assert _positive(row["cpu_ms"]) and _positive(row["ratio"]), (name, row)
        assert row["max_dloss"] < 1e-4, (name, row)  # the same weights, fused: the same losses up to rounding
    assert result["variants"]["unfused"]["ratio"] == 1.0


def test_loss_path_variants_report_time_and_memory(tmp_path):
    tiny = [
        "--dim",
        "32",
        "--n-layers",
        "1",
        "--n-heads",
        "2",
        "--vocab",
        "512",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
    ]
    variants = "native,inplace,chunked-64,chunked-auto"
    result = _run("loss_path", *tiny, "--warmup", "1", "--rounds", "2", "--variants", variants, "--peak", tmp=tmp_path)
    assert list(result["rows"]) == variants.split(",")
    for name, row in result["rows"].items():
        assert _positive(row["cpu_ms"]) and _positive(row["cpu_vs_first"]), (name, row)
        assert row["faults_mib"] >= 0 and math.isfinite(row["peak_rise_mib"]), (name, row)
    assert result["rows"]["native"]["cpu_vs_first"] == 1.0


def test_moe_step_ratio_and_flop_ratio_at_a_tiny_moe(tmp_path):
    recipe = yaml.safe_load((REPO / "configs" / "moe_debug.yaml").read_text())
    recipe["model"]["config"].update(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=256, max_seq_len=32,
                                     multiple_of=16)  # fmt: skip
    recipe["data"].update(micro_batch_size=2, seq_len=16)
    config = tmp_path / "moe_tiny.yaml"
    config.write_text(yaml.safe_dump(recipe))
    # Exit 1: the target (MoE step <= its FLOP ratio x 1.05) is for moe_debug's shape; routing dominates here.
    result = _run(
        "moe_step", "--config", str(config), "--steps", "3", "--warmup", "1", "--hf", tmp=tmp_path, codes=(0, 1)
    )
    assert set(result["median_cpu_ms"]) == {"moe", "dense", "ours_mixtral", "hf_mixtral"}
    assert all(_positive(ms) for ms in result["median_cpu_ms"].values()), result["median_cpu_ms"]
    assert _positive(result["moe_vs_dense_cpu"]) and result["active_flop_ratio"] > 1.0
    assert result["target"] == result["active_flop_ratio"] * 1.05 and isinstance(result["pass"], bool)
    assert result["max_loss_diff_ours_vs_hf"] < 1e-4  # equal networks: ours and HF Mixtral train alike
    assert all(len(losses) == 4 for losses in result["losses"].values())


def test_init_time_previous_and_new_at_a_tiny_decoder(tmp_path):
    tiny = ["--dim", "64", "--n_layers", "2", "--vocab_size", "256", "--repeats", "1"]
    result = _run("init_time", *tiny, tmp=tmp_path)
    assert result["n_params"] > 0 and set(result["best"]) == {"previous", "new"}
    assert _positive(result["cpu_speedup_new_over_previous"]) and _positive(result["wall_speedup_new_over_previous"])
    assert all(len(runs) == 1 for runs in result["runs"].values())


def test_every_benchmark_is_run_by_a_test():
    """A script added to benchmarks/ without a tiny run in the suite (or a test that stops naming its script) fails
    here; the performance page lists every one of them."""
    found = {str(p.relative_to(REPO)) for p in (REPO / "benchmarks").iterdir() if p.suffix in (".py", ".sh")}
    assert found == set(RUN_BY), f"without a test: {sorted(found - set(RUN_BY))}; gone: {sorted(set(RUN_BY) - found)}"
    page = (REPO / "docs" / "performance" / "index.md").read_text()
    for script, test in RUN_BY.items():
        assert Path(script).name in (REPO / test).read_text(), f"{test} does not run {script}"
        assert f"`{script}`" in page, f"docs/performance/index.md does not list {script}"


def test_compile_parts_eager_and_compiled_agree_at_a_tiny_shape(tmp_path):
    tiny = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "2", "--vocab", "256",
            "--multiple-of", "16", "--seq-len", "16", "--batch-size", "2"]  # fmt: skip
    result = _run("compile_parts", *tiny, "--parts", "ce,chunked,embedding", "--reps", "3", tmp=tmp_path)
    assert set(result["parts"]) == {"ce", "chunked", "embedding"}
    assert result["parts"]["ce"]["max_abs_diff"] < 1e-5  # inductor's cross-entropy gradient equals eager's
    assert result["parts"]["chunked"]["max_abs_diff"] < 1e-5  # chunked head + loss equals full logits
    for part in result["parts"].values():
        assert all(_positive(v["speedup"]) for v in part["variants"].values()), part


def test_chunked_ce_memory_writes_both_peaks(tmp_path):
    result = _run("chunked_ce_memory", "--tokens", "64", "--dim", "16", "--vocab", "512", "--chunk", "16", tmp=tmp_path)
    assert result["chunked"]["loss"] == pytest.approx(result["plain"]["loss"], rel=1e-5)
    assert math.isfinite(result["plain"]["peak_rise_mib"]) and _positive(result["ratio"])


def test_startup_reports_the_import_breakdown_without_timed_pairs(tmp_path):
    """--pairs 0 --phase-runs 0: one instrumented `kforge fit --trainer.max_steps=1` under -X importtime (the timed
    pairs are the same commands, measured)."""
    result = _run("startup", "--pairs", "0", "--phase-runs", "0", tmp=tmp_path)
    assert result["pairs"] == [] and result["phases"] == {}
    assert _positive(result["imports"]["total_self_s"]) and "torch" in result["imports"]["self_s_by_package"]


def test_data_io_variants_count_the_same_tokens_and_the_loaders_report(tmp_path):
    """Issue 30 item 5 at a tiny shape: every tokenizing variant (raw encode_batch, prepare-data at 1 and 2 workers,
    datasets.map) counts the same tokens of the same text, the ratios are finite, both loaders deliver batches."""
    tiny = ["--mb", "0.2", "--workers", "2", "--shard-bytes", "65536", "--repeats", "1", "--loader-seq", "128",
            "--loader-batches", "3", "--loader-warmup", "1"]  # fmt: skip
    result = _run("data_io", *tiny, tmp=tmp_path)
    t = result["tokenize"]
    assert set(t["best"]) == {"encode_batch_1@1", "encode_batch@2", "prepare@1", "prepare@2", "datasets_map@2"}
    assert len(t["tokens"]) == 1 and t["tokens"][0] > 40_000  # one count: the same ids, EOS per document included
    assert all(_positive(r["tokens_per_s"]) and _positive(r["tokens_per_cpu_s"]) for r in t["best"].values())
    assert all(_positive(v) for v in [*t["wall_ratios"].values(), *t["cpu_ratios"].values()])
    loader = result["loader"]
    assert loader["tokens_per_step_per_rank"] == 8192 and loader["flops_per_token"] > 5e10  # the 8B recipe's shape
    assert all(_positive(row["tokens_per_s_per_rank"]) for row in loader["loaders"].values())


def test_checkpoint_io_figures_at_a_tiny_decoder_on_two_processes(tmp_path):
    """Issue 30, item 4: save / restore GB/s next to the disk's own, restores equal to what was saved, the async
    save's stall and the host copy it is compared with, in the JSON the README quotes."""
    result = _run("checkpoint_io", "--params", "1e6", "--nproc", "2", "--seq", "16", "--rounds", "1",
                  "--dir", str(tmp_path), tmp=tmp_path)  # fmt: skip
    assert result["machine"] and result["date"] and len(result["results"]) == 1
    row = result["results"][0]
    assert row["nproc"] == 2 and row["params"] >= 1e6 and row["restored_equal"] is True
    for key in ("disk_write_gb_s", "disk_read_gb_s", "save_gb_s", "save_plain_gb_s", "restore_gb_s",
                "restore_plain_gb_s", "save_of_disk", "restore_of_disk", "step_s", "copy_floor_s", "prestage_s"):  # fmt: skip
        assert _positive(row[key]), (key, row[key])
    assert len(row["async_stall_s"]) == 3 and all(_positive(x) for x in row["async_stall_s"])
    assert _positive(row["async_stall_median_s"]) and _positive(row["async_stall_of_step"])
    assert len(row["ranks"]) == 2 and all(len(r["rounds"]) == 1 for r in row["ranks"])
    assert not list(tmp_path.glob("ckpt_io_*"))  # its files are removed


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchft") is None, reason="torchft not installed")
def test_replica_groups_cost_counts_the_extra_collectives(tmp_path):
    """Issue 31 check 5 at a tiny shape: both runs train to the same losses, and per step fault tolerance makes one
    cross-group all-reduce per FSDP2 unit (HSDP's replicate all-reduces) plus one for the step's token count (HSDP's
    single world all-reduce becomes an in-group one and a cross-group one), one quorum request and one commit vote, and
    no host synchronization."""
    tiny = ["--dim", "32", "--layers", "1", "--seq-len", "16", "--batch", "2", "--steps", "4", "--warmup", "2"]
    result = _run("replica_groups", *tiny, tmp=tmp_path)
    assert result["losses_equal"] and _positive(result["ft_over_hsdp"])
    hsdp, ft = result["hsdp_per_step"], result["ft_per_step"]
    units = hsdp["_reduce_scatter_base_@2"]
    assert hsdp["allreduce_@2"] == units and hsdp["allreduce_@4"] == 1
    assert ft["torchft.allreduce"] == units + 1 and ft["torchft.start_quorum"] == ft["torchft.should_commit"] == 1
    assert ft["_reduce_scatter_base_@2"] == units and ft["_allgather_base_@2"] == hsdp["_allgather_base_@2"]
    # Host synchronizations of the training thread (tests/host_syncs.py): none added (the benchmark's own read of the
    # loss is the one both count); torchft's vote is a blocking round trip, not a tensor read-back.
    assert (
        result["ft_host_syncs_per_step"]
        == result["hsdp_host_syncs_per_step"]
        == ["__float__@benchmarks/replica_groups.py"]
    )
