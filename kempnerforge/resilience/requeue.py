"""SLURM requeue: ``scontrol requeue <job id>`` from one rank."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

log = logging.getLogger(__name__)


def slurm_job_id(env: dict[str, str] | None = None) -> str | None:
    """The job to requeue: ``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID`` for array jobs, else ``SLURM_JOB_ID``."""
    env = os.environ if env is None else env
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return env.get("SLURM_JOB_ID")


def requeue_slurm_job(timeout_s: float = 60.0) -> bool:
    """Run ``scontrol requeue <job id>`` (the ``scontrol`` found on PATH).

    Returns:
        True when the command exited 0; False (logged) when not under SLURM, ``scontrol`` is missing,
        or the command failed. Never raises: a failed requeue must not lose the checkpoint just written.
    """
    job_id = slurm_job_id()
    if job_id is None:
        log.warning("Preemption: requeue asked but SLURM_JOB_ID is not set; not requeueing.")
        return False
    exe = shutil.which("scontrol")
    if exe is None:
        log.warning("Preemption: `scontrol` not found on PATH; job %s not requeued.", job_id)
        return False
    try:
        proc = subprocess.run([exe, "requeue", job_id], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("Preemption: `scontrol requeue %s` failed: %s", job_id, err)
        return False
    if proc.returncode != 0:
        log.warning("Preemption: `scontrol requeue %s` exited %d: %s", job_id, proc.returncode, proc.stderr.strip())
    return proc.returncode == 0
