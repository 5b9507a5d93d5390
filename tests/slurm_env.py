"""SLURM environment variables of one local task, shared by the unit and e2e SLURM tests."""

from __future__ import annotations


def slurm_task_env(rank: int, ntasks: int = 2, job_id: str = "4242") -> dict[str, str]:
    """What ``srun`` sets for task ``rank`` of a ``ntasks``-task job on one node (127.0.0.1)."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "kf-test",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": str(ntasks),
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODELIST": "127.0.0.1",
    }
