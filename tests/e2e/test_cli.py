"""The `kforge` console script: help, print_config, overrides, prepare-data (in-process: they only parse, print
or prepare), and a short real 2-process run of the script itself (subprocesses)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.inprocess import kforge_in_process
from tests.procs import run_group

REPO = Path(__file__).resolve().parents[2]
KFORGE = [sys.executable, "-m", "kempnerforge.cli"]


def _kforge(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    proc = run_group([*KFORGE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def test_fit_help_documents_model_data_and_strategy_arguments():
    proc = kforge_in_process("fit", "--config", "configs/debug.yaml", "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for arg in (
        "--model.config.n_kv_heads",
        "--model.optimizer.lr",
        "--model.scheduler.warmup_steps",
        "--data.micro_batch_size",
        "--data.seq_len",
        "--trainer.max_steps",
    ):
        assert arg in out, arg
    assert "Peak learning rate" in out  # field docstrings become the help text
    assert "Number of key/value heads" in out or "n_kv_heads" in out


def test_print_config_applies_overrides():
    proc = kforge_in_process(
        "fit",
        "--config",
        "configs/debug.yaml",
        "--trainer.max_steps=50",
        "--model.optimizer.lr=1e-3",
        "--trainer.strategy.init_args.dp_shard=1",
        "--print_config",
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["trainer"]["max_steps"] == 50
    assert cfg["model"]["optimizer"]["lr"] == 1e-3
    assert cfg["trainer"]["strategy"]["class_path"] == "kempnerforge.strategies.KempnerStrategy"
    assert cfg["trainer"]["strategy"]["init_args"]["dp_shard"] == 1
    assert cfg["model"]["config"]["vocab_size"] == 50257
    assert "vocab_size" not in cfg["data"]  # derived from the model through link_arguments, not set twice


def test_bad_config_value_names_the_field():
    proc = kforge_in_process("fit", "--config", "configs/debug.yaml", "--model.config.n_kv_heads=3")
    assert proc.returncode != 0
    assert "ModelConfig.n_kv_heads=3 must divide n_heads=4" in proc.stderr
    assert "allowed: [1, 2, 4]" in proc.stderr


def test_prepare_data_hangs_off_the_same_entry_point(tmp_path, shakespeare_text, gpt2_tokenizer_dir):
    src = tmp_path / "a.txt"
    src.write_text(shakespeare_text.read_text()[:5000])
    proc = kforge_in_process(
        "prepare-data",
        "--source",
        str(src),
        "--tokenizer",
        str(gpt2_tokenizer_dir),
        "--output_dir",
        str(tmp_path / "tok"),
    )
    assert proc.returncode == 0, proc.stderr
    meta = yaml.safe_load((tmp_path / "tok" / "metadata.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 50257 and meta["num_tokens"] > 1000


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("output_dir_not_empty", "--output_dir: output_dir '{tok}' is not empty"),
        ("missing_source", "--source: '/nonexistent/corpus' does not exist"),
        ("missing_tokenizer", "--tokenizer: '/nonexistent/tok' does not exist"),
        ("text_field", "--text_field: text_field='body' is not a column"),
        ("shard_bytes", "--shard_bytes: shard_bytes must be a positive integer, got 0"),
        ("unknown_option", "--bogus: unknown option"),
        ("abbreviation", "--out: unknown option"),
    ],
)
def test_prepare_data_bad_input_is_one_line(case, expected, tmp_path, gpt2_tokenizer_dir):
    """A wrong path or value of ``kforge prepare-data`` is one line naming the option, exit 2 (no traceback)."""
    src, tok = tmp_path / "a.jsonl", tmp_path / "tok"
    src.write_text('{"text": "To be, or not to be"}\n')
    tok.mkdir()
    (tok / "shard_00000.npy").write_bytes(b"")
    args = {"--source": str(src), "--tokenizer": str(gpt2_tokenizer_dir), "--output_dir": str(tok)}
    if case != "output_dir_not_empty":
        args["--output_dir"] = str(tmp_path / "out")
    extra = {
        "missing_source": {"--source": "/nonexistent/corpus"},
        "missing_tokenizer": {"--tokenizer": "/nonexistent/tok"},
        "text_field": {"--text_field": "body"},
        "shard_bytes": {"--shard_bytes": "0"},
        "unknown_option": {"--bogus": "1"},
    }.get(case, {})
    argv = [x for kv in {**args, **extra}.items() for x in kv]
    if case == "abbreviation":
        argv = [a.replace("--output_dir", "--out") for a in argv]
    proc = kforge_in_process("prepare-data", *argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("kforge: error: " + expected.format(tok=tok)), line


@pytest.mark.slow
def test_debug_recipe_short_run_checkpoints_and_resumes(tmp_path, shakespeare_tokens):
    """The debug recipe for 8 steps on 2 processes writes a DCP checkpoint that a second run resumes.

    Issue 18 check 1 rides on the same runs: with stdout a file (a SLURM .out), global rank 0 prints one plain
    progress line per log interval (step, loss, lr, grad norm, tokens/s, MFU, memory, elapsed, ETA), the
    model summary has no FLOPs column, and the known-harmless warnings are gone from both ranks' stderr."""
    common = [
        "fit",
        "--config",
        "configs/debug.yaml",
        f"--data.data_dir={shakespeare_tokens}",
        "--data.seq_len=64",
        "--data.micro_batch_size=2",
        "--trainer.val_check_interval=4",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=2",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.init_args.every_n_train_steps=4",
        "--trainer.devices=2",
        "--model.scheduler.total_steps=8",  # the planned run; the first invocation stops halfway
    ]
    proc = _kforge(*common, "--trainer.max_steps=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = _assert_batch_log(proc, steps=[2, 4], total=4)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step=000004.ckpt"
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step=000004.ckpt").glob("rank_*.pt")) == [
        "rank_00000.pt",
        "rank_00001.pt",
    ]
    proc = _kforge(*common, "--trainer.max_steps=8", f"--ckpt_path={tmp_path / 'ckpt'}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed.update(_assert_batch_log(proc, steps=[6, 8], total=8))
    assert "exists and is not empty" not in proc.stderr  # resuming from that folder
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step=000008.ckpt"
    # Refused after the process group started (Lightning's launcher: rank 0 is the command, rank 1 its child): the
    # one line, once, without Lightning's start-up lines.
    proc = _kforge(*common, "--trainer.max_steps=12", "--data.micro_batch_size=4", f"--ckpt_path={tmp_path / 'ckpt'}")
    assert proc.returncode == 2 and proc.stdout.strip() == "", proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kforge: error: data.micro_batch_size: resuming must keep"), lines
    assert sorted(p.name for p in (tmp_path / "runs").rglob("version_*")) == ["version_0", "version_1"]  # none new
    events = list((tmp_path / "runs").rglob("events.out.tfevents.*"))
    assert events
    # `kforge validate` on the step-8 checkpoint reproduces the validation loss the run logged at step 8.
    validate = [a for a in common if not a.startswith(("--trainer.callbacks", "--model.scheduler"))]
    validate[0] = "validate"
    proc = _kforge(*validate, f"--ckpt_path={tmp_path / 'ckpt' / 'step=000008.ckpt'}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.search(r"val/loss\s*│\s*([0-9.]+)", proc.stdout)
    assert found, proc.stdout[-2000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged, train_loss = {}, {}
    for ev in events:
        acc = EventAccumulator(str(ev))
        acc.Reload()
        if "val/loss" in acc.Tags()["scalars"]:
            logged.update({e.step: e.value for e in acc.Scalars("val/loss")})
        if "train/loss" in acc.Tags()["scalars"]:
            train_loss.update({e.step + 1: e.value for e in acc.Scalars("train/loss")})  # logged at step - 1
    # the printed losses are the logged ones (4 decimals)
    assert printed == pytest.approx({step: train_loss[step] for step in printed}, abs=1e-4), (printed, train_loss)
    assert float(found.group(1)) == pytest.approx(logged[max(logged)], rel=1e-5), (found.group(1), logged)


#: One progress line of a batch log (kempnerforge.callbacks.ProgressBar, lines rendering).
PROGRESS_LINE = re.compile(
    r"^step (\d+)/(\d+) \| loss (\d+\.\d{4}) \| lr \S+ \| grad_norm \S+ \| tokens/s ([\d,]+) \| MFU (\d+\.\d)% \| "
    r"peak_mem \d+\.\d\dGiB \| elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d$",
    re.M,
)
#: Known-harmless third-party warnings kforge filters (kempnerforge.console).
FILTERED = ("set_vital", "LeafSpec", "litlogger", "KernelPreference", "Failed to load")


def _assert_batch_log(proc: subprocess.CompletedProcess, steps: list[int], total: int) -> dict[int, float]:
    """The progress lines of a run's stdout are those of ``steps`` with their fields; step -> printed loss."""
    lines = PROGRESS_LINE.findall(proc.stdout)
    assert [int(step) for step, *_ in lines] == steps, proc.stdout[-3000:]  # once: rank 0 only
    for _, run_total, loss, tokens_per_s, mfu in lines:
        assert int(run_total) == total and 0 < float(loss) < 12  # ln(50257) = 10.8 at init
        assert int(tokens_per_s.replace(",", "")) > 0 and 0 < float(mfu) < 100
    assert "%|" not in proc.stdout  # no bar drawn into the file
    # The summary goes through Lightning's logger (stderr, as Lightning's own), held until the run's checks pass.
    assert "FLOPs" not in proc.stdout + proc.stderr and "Total params" in proc.stderr
    for text in FILTERED:
        assert text not in proc.stderr, text
    return {int(step): float(loss) for step, _, loss, *_ in lines}


def test_a_data_module_validation_error_is_printed_alone():
    """A component's own check (raised in its __init__) reaches the user as one line, not inside jsonargparse's
    union-type report that ends with the whole config."""
    proc = kforge_in_process("fit", "--config", "configs/vlm_video.yaml", "--data.init_args.fps=0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kforge: error: data.fps: data.fps=0.0 must be a finite number > 0 (frames per second)."
    ]
