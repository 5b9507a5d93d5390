"""The command line of the scripts that run several ``Trainer.fit`` in one launch (``pp_script.py``,
``fp8_tp_script.py``, ``moe_tp_script.py``): one launch's rendezvous and imports serve many runs.

``--data`` (token folder), ``--out`` (JSON written by rank 0: ``{run name: record}``), ``--runs name:key=value,...``
and, for scripts whose runs save checkpoints, ``--ckpt-root``. Deterministic algorithms are on for every run.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch


def parse_run(spec: str, int_keys: Iterable[str] = ()) -> tuple[str, dict]:
    """``"a:pp=2,schedule=gpipe"`` -> ``("a", {"pp": 2, "schedule": "gpipe"})`` (``int_keys`` become ints)."""
    name, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    keys = set(int_keys)
    return name, {k: int(v) if k in keys else v for k, v in opts.items()}


def main(
    run: Callable[[str, dict, argparse.Namespace], dict], int_keys: Iterable[str], ckpt_root: bool = False
) -> None:
    """Parse the command line, call ``run(name, opts, args)`` for every ``--runs`` entry in order, write the records.

    Args:
        run: one fit; returns its JSON-able record (every rank runs it; rank 0's record is written).
        int_keys: option keys parsed as ints.
        ckpt_root: the script takes ``--ckpt-root`` (a folder its runs save under).
    """
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    if ckpt_root:
        p.add_argument("--ckpt-root", required=True)
    p.add_argument("--runs", nargs="+", required=True)
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    records = {}
    for spec in args.runs:
        name, opts = parse_run(spec, int_keys)
        records[name] = run(name, opts, args)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(records))
