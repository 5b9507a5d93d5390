"""``kforge estimate``: will this recipe build and fit on N nodes x G GPUs? Simulated here, on any machine.

    kforge estimate --config configs/llama3_70b.yaml --num_nodes 8 --devices_per_node 8
    kforge estimate --config configs/llama3_8b.yaml --num_nodes 1 --devices_per_node 8 --json est.json \\
        --trainer.strategy.init_args.activation_checkpointing=none
    kforge estimate --config configs/pp_debug.yaml --num_nodes 1 --devices_per_node 2 --plot memory.png

Every argument that is not one of the estimate's own is a ``kforge fit`` argument (``--config`` and
overrides), parsed by the same CLI. The report goes to stdout, progress lines to stderr. Exit status: 0 it
fits, 3 it does not fit, 2 bad input (one ``kforge: error: ...`` line, before anything is built), 1 a step the
simulation cannot run (one line naming the code).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import NoReturn

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
    p.add_argument("--gpu_memory_gb", type=float, default=80.0, help="memory of one GPU in GB (1e9 bytes); 80")
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
        help="when it does not fit, only reason from the breakdown (no extra simulated steps for AC / micro-batch "
        "/ chunked-loss alternatives)",
    )
    return p


def _check(args: argparse.Namespace, fit_args: list[str], parser: argparse.ArgumentParser) -> None:
    for name in ("num_nodes", "devices_per_node"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: must be an integer >= 1")
    if not args.gpu_memory_gb > 0:
        parser.error(f"--gpu_memory_gb={args.gpu_memory_gb}: must be a number > 0")
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
