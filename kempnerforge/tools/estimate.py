"""``kforge estimate``: will this recipe build and fit on N nodes x G GPUs? Simulated here, on any machine.

    kforge estimate --config configs/llama3_70b.yaml --num_nodes 8 --devices_per_node 8
    kforge estimate --config configs/llama3_8b.yaml --num_nodes 1 --devices_per_node 8 --json est.json \\
        --trainer.strategy.init_args.activation_checkpointing=none
    kforge estimate --config configs/pp_debug.yaml --num_nodes 1 --devices_per_node 2 --plot memory.png
    kforge estimate --config configs/llama3_8b.yaml --num_nodes 1 --devices_per_node 1 --gpu h200 \\
        --suggest gpus,activation_checkpointing --allowance.fragmentation 0.15

Every argument that is not one of the estimate's own (``--num_nodes``, ``--devices_per_node``, ``--gpu``,
``--gpu_memory_gb``, ``--json``, ``--plot``, ``--no_alternatives``, ``--suggest``, ``--allowance.*``) is a ``kforge fit``
argument (``--config`` and overrides), parsed by the same CLI. The verdict and its suggestions:
:mod:`kempnerforge.estimate.verdict`; the allowance model: :mod:`kempnerforge.estimate.allowance`. The report
goes to stdout, progress lines to stderr. Exit status: 0 it fits, 3 it does not fit, 2 bad input (one
``kforge: error: ...`` line, before anything is built), 1 a step the simulation cannot run (one line naming the
code).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import NoReturn

# Neither imports torch: --help and the argument checks answer at once.
from kempnerforge.estimate.allowance import GPU_KINDS, Allowance
from kempnerforge.estimate.verdict import KNOBS

#: Exit status when the configuration does not fit.
DOES_NOT_FIT = 3
#: What ``--plot`` writes (:func:`kempnerforge.estimate.plot.write`).
PLOT_SUFFIXES = (".png", ".html")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"kforge: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The estimate's own options (the rest of the command line goes to the ``kforge fit`` parser)."""
    p = _Parser(
        prog="kforge estimate",
        allow_abbrev=False,
        description="Simulate a kforge fit configuration on num_nodes x devices_per_node GPUs (fake process group "
        "and fake tensors: nothing is allocated) and report per-rank memory, FLOPs, collective bytes and whether "
        "it fits. Any other argument is a kforge fit argument (--config, overrides such as "
        "--trainer.strategy.init_args.tp=8).",
    )
    p.add_argument("--num_nodes", type=int, required=True, help="nodes of the simulated cluster")
    p.add_argument("--devices_per_node", type=int, required=True, help="GPUs (ranks) per node")
    p.add_argument(
        "--gpu",
        default="h100",
        choices=sorted(GPU_KINDS),
        help="the GPU kind: its memory (unless --gpu_memory_gb), CUDA context and kernel workspaces; h100",
    )
    p.add_argument(
        "--gpu_memory_gb",
        type=float,
        default=None,
        help="memory of one GPU in GB (1e9 bytes); the kind's by default (a100 80, h100 80, h200 141, b200 180)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the estimate as JSON to PATH")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also draw memory over the simulated step (stacked by category, one row per role, modules ranked by "
        "peak) to PATH: .png, or .html (self-contained, opens offline); needs matplotlib (the plot extra)",
    )
    p.add_argument(
        "--no_alternatives",
        action="store_true",
        help="when it does not fit, print no suggestions (each suggestion is one more simulated step per role)",
    )
    p.add_argument(
        "--suggest",
        default=None,
        metavar="KNOB[,KNOB...]",
        help=f"the knobs suggestions may change when it does not fit: {', '.join(KNOBS)} (all by default)",
    )
    g = p.add_argument_group("allowance", "what a GPU holds besides the tracked tensors (defaults: the GPU kind's)")
    for name, kind, what in ALLOWANCE_OPTIONS:
        g.add_argument(f"--allowance.{name}", dest=name, type=kind, default=None, help=what)
    return p


#: ``--allowance.<name>``: type, help. GB and MB are 1e9 and 1e6 bytes.
ALLOWANCE_OPTIONS = (
    ("cuda_context_gb", float, "CUDA context per GPU in GB (a100 0.5, h100 / h200 / b200 0.6)"),
    ("workspace_gb", float, "kernel workspaces (cuBLAS) per GPU in GB (sm90: 2 x 32 MiB, else 2 x 8.125 MiB)"),
    ("nccl_channels", int, "NCCL channels per communicator (NCCL_MAX_NCHANNELS if you set it); 16"),
    ("nccl_buffer_mb", float, "NCCL buffer bytes per channel and connection in MB, all protocols; 9.63"),
    ("fragmentation", float, "share of the tracked peak lost to allocator fragmentation; 0.05"),
)


def _check(args: argparse.Namespace, fit_args: list[str], parser: argparse.ArgumentParser) -> None:
    for name in ("num_nodes", "devices_per_node"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: must be an integer >= 1")
    if args.gpu_memory_gb is not None and not args.gpu_memory_gb > 0:
        parser.error(f"--gpu_memory_gb={args.gpu_memory_gb}: must be a number > 0")
    unknown = sorted(set(_knobs(args) or ()) - set(KNOBS))
    if unknown:
        parser.error(f"--suggest={args.suggest}: {', '.join(unknown)} is not a knob; use {', '.join(KNOBS)}")
    for name, _, _ in ALLOWANCE_OPTIONS:
        value = getattr(args, name)
        if value is None:
            continue
        if name == "nccl_channels" and value < 1:
            parser.error(f"--allowance.{name}={value}: must be an integer >= 1")
        if name == "fragmentation" and not 0 <= value < 1:
            parser.error(f"--allowance.{name}={value}: must be a fraction in [0, 1)")
        if not value >= 0:
            parser.error(f"--allowance.{name}={value}: must be a number >= 0")
    if args.json is not None:
        parent = Path(args.json).parent
        if Path(args.json).is_dir():
            parser.error(f"--json={args.json}: is a folder; give the path of the JSON file to write")
        if not parent.is_dir():
            parser.error(f"--json={args.json}: the folder {parent} does not exist (create it first)")
    if args.plot is not None:
        _check_plot(args.plot, parser)
    if not any(a == "--config" or a.startswith("--config=") for a in fit_args):
        parser.error("--config: give the recipe to estimate (e.g. --config configs/llama3_8b.yaml)")
    for flag in ("--trainer.devices", "--trainer.num_nodes", "--trainer.accelerator"):
        if any(a == flag or a.startswith(flag + "=") for a in fit_args):
            parser.error(f"{flag}: set by the estimate; use --num_nodes / --devices_per_node instead")


def _check_plot(path: str, parser: argparse.ArgumentParser) -> None:
    # Checked here, without importing the estimate package (torch): a refused --plot costs nothing.
    if Path(path).suffix.lower() not in PLOT_SUFFIXES:
        parser.error(f"--plot={path}: give a path ending in {' or '.join(PLOT_SUFFIXES)}")
    if not Path(path).parent.is_dir():
        parser.error(f"--plot={path}: the folder {Path(path).parent} does not exist (create it first)")
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot: needs matplotlib, which is not installed (pip install 'kempnerforge[plot]')")


def _recipe(fit_args: list[str]) -> str | None:
    """The last ``--config`` of a fit command line (the recipe the plot's title names)."""
    found = None
    for i, a in enumerate(fit_args):
        if a == "--config" and i + 1 < len(fit_args):
            found = fit_args[i + 1]
        elif a.startswith("--config="):
            found = a.split("=", 1)[1]
    return found


def _knobs(args: argparse.Namespace) -> list[str] | None:
    return None if args.suggest is None else [k.strip() for k in args.suggest.split(",") if k.strip()]


def allowance_of(args: argparse.Namespace) -> Allowance:
    """The allowance model of ``--gpu`` with the ``--allowance.*`` overrides (GB / MB to bytes)."""

    def scaled(value: float | None, unit: float) -> int | None:
        return None if value is None else int(value * unit)

    return Allowance.for_gpu(
        args.gpu,
        cuda_context_bytes=scaled(args.cuda_context_gb, 1e9),
        workspace_bytes=scaled(args.workspace_gb, 1e9),
        nccl_channels=args.nccl_channels,
        nccl_connection_bytes=scaled(args.nccl_buffer_mb, 1e6),
        fragmentation=args.fragmentation,
    )


def estimate_main(argv: list[str]) -> None:
    """Entry point of ``kforge estimate`` (``argv`` without the subcommand).

    Raises:
        SystemExit: 2 on bad input, 3 when the configuration does not fit, 1 when the step cannot be simulated.
    """
    parser = build_parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return
    args, fit_args = parser.parse_known_args(argv)
    _check(args, fit_args, parser)

    from kempnerforge.cli_errors import HeldLogs, exit_with_error
    from kempnerforge.estimate import estimate, format_text
    from kempnerforge.estimate.fake_ops import FakeTensorLimitError
    from kempnerforge.estimate.run import EstimateConfigError

    # Lightning's start-up lines wait for the first progress line (the checks passed), as under `kforge fit`.
    held = HeldLogs().hold()

    def progress(message: str) -> None:
        held.show()
        print(f"[estimate] {message}", file=sys.stderr, flush=True)

    try:
        est = estimate(
            fit_args,
            args.num_nodes,
            args.devices_per_node,
            gpu_memory_gb=args.gpu_memory_gb,
            progress=progress,
            alternatives=not args.no_alternatives,
            allowance=allowance_of(args),
            knobs=_knobs(args),
        )
    except EstimateConfigError as err:
        held.drop()
        exit_with_error(err.__cause__ or err)  # the field first, as kforge fit names it
    except FakeTensorLimitError as err:  # not bad input: a limit of the simulation, named
        held.show()
        print(f"kforge: error: {err}", file=sys.stderr)
        raise SystemExit(1) from err
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            held.drop()  # a parse error: its one line is printed already
        raise
    finally:
        held.show()
    print(format_text(est))
    if args.json:
        est.write_json(args.json)
        progress(f"wrote {args.json}")
    if args.plot:
        from kempnerforge.estimate.plot import write

        write(est, args.plot, _recipe(fit_args))
        progress(f"wrote {args.plot}")
    if est.verdict is not None and not est.verdict.fits:
        raise SystemExit(DOES_NOT_FIT)
