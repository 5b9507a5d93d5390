"""``kforge check-env``: is this machine / job ready to train? An OK / WARN / MISSING list.

    kforge check-env                              # inside or outside a SLURM job
    kforge check-env --accelerator gpu --ckpt_dir /shared/ckpt --strict

Checks: torch / Lightning versions, CUDA and GPUs, NCCL, the SLURM job, the checkpoint folder
(writable? on a shared filesystem that every node sees?) and the loggers' credentials (W&B, MLflow).

Exit status: 0 when nothing is MISSING (WARNs allowed), 1 with ``--strict`` when something is WARN,
2 when something is MISSING (e.g. no CUDA device with ``--accelerator gpu``, or a checkpoint folder
that cannot be written).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kempnerforge.cli_errors import ToolArgumentParser

OK, WARN, MISSING = "OK", "WARN", "MISSING"
#: Filesystems that several nodes share (from ``/proc/mounts``); checkpoints elsewhere are node-local.
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "wekafs", "cifs", "ceph", "fuse.ceph", "panfs", "vast")
#: NCCL / network variables worth showing when set (see scripts/slurm/README.md).
NCCL_VARS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_DEBUG", "NCCL_ASYNC_ERROR_HANDLING",
             "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_NET_GDR_LEVEL", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


@dataclass
class Check:
    """One line of the report: ``status`` is OK, WARN or MISSING."""

    name: str
    status: str
    detail: str


def check_cuda(accelerator: str) -> list[Check]:
    """CUDA devices and NCCL; MISSING only when ``accelerator == "gpu"`` asks for them."""
    needed = MISSING if accelerator == "gpu" else WARN
    if accelerator == "cpu":
        return [Check("cuda", OK, "not needed (--accelerator cpu)")]
    if not torch.cuda.is_available():
        return [Check("cuda", needed, f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"),
                Check("nccl", needed, "NCCL needs CUDA devices; multi-GPU training unavailable")]  # fmt: skip
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    checks = [Check("cuda", OK, f"{torch.cuda.device_count()} GPU(s): {', '.join(names)}; CUDA {torch.version.cuda}")]
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else ""
    checks.append(Check("nccl", OK if nccl else needed, f"NCCL {version}" if nccl else "torch built without NCCL"))
    return checks


def check_slurm(env: Mapping[str, str]) -> Check:
    """OK inside a SLURM job; WARN outside one (or without SLURM on PATH)."""
    if env.get("SLURM_JOB_ID"):
        nodes, tasks = env.get("SLURM_JOB_NUM_NODES", "?"), env.get("SLURM_NTASKS", "?")
        return Check("slurm", OK, f"job {env['SLURM_JOB_ID']}: {nodes} node(s), {tasks} task(s)")
    if shutil.which("srun", path=env.get("PATH")):
        return Check("slurm", WARN, "SLURM installed but not inside a job (use sbatch scripts/slurm/*.sbatch)")
    return Check("slurm", WARN, "no SLURM (srun not on PATH): single-node runs only")


def filesystem_type(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """Type of the filesystem holding ``path`` (longest mount point prefix in ``mounts``), or None if unknown."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    best, fstype = "", None
    resolved = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) >= len(best):
                best, fstype = parts[1], parts[2]
    return fstype


def check_ckpt_dir(ckpt_dir: str, mounts: str = "/proc/mounts") -> Check:
    """MISSING when the folder cannot be created or written; WARN when it is on a node-local filesystem."""
    path = Path(ckpt_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as err:
        return Check("checkpoint dir", MISSING, f"{path} is not writable: {err.strerror or err}")
    fstype = filesystem_type(path, mounts)
    if fstype in SHARED_FS:
        return Check("checkpoint dir", OK, f"{path} writable, shared filesystem ({fstype})")
    return Check("checkpoint dir", WARN, f"{path} writable but on {fstype or 'an unknown'} filesystem: other nodes "
                                          "may not see it (multi-node runs need a shared folder)")  # fmt: skip


def check_loggers(env: Mapping[str, str]) -> list[Check]:
    """W&B: an API key (env or ~/.netrc) or offline mode; MLflow: a tracking URI. WARN when absent."""
    netrc = Path(env.get("HOME", "~")).expanduser() / ".netrc"
    has_netrc = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    if env.get("WANDB_API_KEY") or has_netrc:
        wandb = Check("wandb", OK, "API key found (WANDB_API_KEY or ~/.netrc)")
    elif env.get("WANDB_MODE") in ("offline", "disabled"):
        wandb = Check("wandb", OK, f"WANDB_MODE={env['WANDB_MODE']}: no key needed")
    else:
        wandb = Check("wandb", WARN, "no WANDB_API_KEY / ~/.netrc entry: set one, or WANDB_MODE=offline")
    uri = env.get("MLFLOW_TRACKING_URI")
    mlflow = (
        Check("mlflow", OK, f"MLFLOW_TRACKING_URI={uri}")
        if uri
        else Check("mlflow", WARN, "MLFLOW_TRACKING_URI unset: an MLFlowLogger writes to a local ./mlruns")
    )
    return [wandb, mlflow]


def run_checks(accelerator: str, ckpt_dir: str, env: Mapping[str, str], mounts: str = "/proc/mounts") -> list[Check]:
    """Every check, in report order."""
    from importlib.metadata import version  # not `import lightning`: seconds of start-up for one string

    checks = [Check("torch", OK, f"torch {torch.__version__}, lightning {version('lightning')}")]
    checks += check_cuda(accelerator)
    checks.append(check_slurm(env))
    checks.append(check_ckpt_dir(ckpt_dir, mounts))
    checks += check_loggers(env)
    nccl_env = [f"{k}={env[k]}" for k in NCCL_VARS if k in env]
    checks.append(Check("network env", OK, ", ".join(nccl_env) if nccl_env else "no NCCL_* / MASTER_* set (defaults)"))
    return checks


def exit_code(checks: list[Check], strict: bool) -> int:
    """2 if anything is MISSING; 1 if ``strict`` and anything is WARN; else 0."""
    statuses = {c.status for c in checks}
    if MISSING in statuses:
        return 2
    return 1 if strict and WARN in statuses else 0


def check_env_main(argv: list[str] | None = None) -> int:
    """Entry point of ``kforge check-env``: prints the report and exits with :func:`exit_code`."""
    p = ToolArgumentParser(prog="kforge check-env", description=__doc__.split("\n\n")[0])
    p.add_argument("--accelerator", default="auto", choices=("auto", "gpu", "cpu"),
                   help="gpu: a missing CUDA device / NCCL is MISSING (exit 2); auto/cpu: WARN")  # fmt: skip
    p.add_argument("--ckpt_dir", default="checkpoints", help="where checkpoints will be written")
    p.add_argument("--strict", action="store_true", help="exit 1 when anything is WARN")
    args = p.parse_args(argv)
    checks = run_checks(args.accelerator, args.ckpt_dir, os.environ)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.status:<8} {c.name:<{width}}  {c.detail}")
    code = exit_code(checks, args.strict)
    print(f"check-env: exit {code} ({'MISSING items' if code == 2 else 'warnings' if code == 1 else 'ready'})")
    sys.exit(code)
