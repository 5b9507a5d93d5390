"""``kforge lighthouse``: run torchft's lighthouse, the coordinator of replica-group fault tolerance.

    kforge lighthouse --min_replicas 1                  # prints the address, serves until interrupted
    kforge lighthouse --min_replicas 2 --port 29510 --address_file lighthouse.txt

Every replica group's ``trainer.strategy.init_args.fault_tolerance.lighthouse`` (or ``$TORCHFT_LIGHTHOUSE``) is the
printed ``http://host:port``. The lighthouse forms a quorum of the groups alive at each step once at least
``--min_replicas`` ask (torchft, https://github.com/pytorch/torchft; torchft's own ``torchft_lighthouse`` script is
the same server). Needs the ``ft`` extra (``pip install 'kempnerforge[ft]'``).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from kempnerforge.cli_errors import ToolArgumentParser


def build_parser() -> ToolArgumentParser:
    """The ``kforge lighthouse`` options."""
    p = ToolArgumentParser(prog="kforge lighthouse", description="Run torchft's lighthouse for replica groups.")
    p.add_argument("--min_replicas", type=int, default=1, help="fewest groups a quorum may have (>= 1; default 1)")
    p.add_argument("--port", type=int, default=0, help="TCP port to listen on (0: any free port; default 0)")
    p.add_argument(
        "--join_timeout_ms",
        type=int,
        default=60_000,
        help="ms a new quorum waits for the previous quorum's groups to ask again (default 60000)",
    )
    p.add_argument(
        "--heartbeat_timeout_ms",
        type=int,
        default=5_000,
        help="ms without a heartbeat after which a group counts as gone (default 5000)",
    )
    p.add_argument("--quorum_tick_ms", type=int, default=100, help="ms between quorum checks (default 100)")
    p.add_argument("--address_file", default=None, help="also write the address to this file (for job scripts)")
    return p


def serve(args, stop: threading.Event) -> str:
    """Start the lighthouse, print (and write) its address, serve until ``stop`` is set; returns the address.

    Raises:
        SystemExit(2): torchft is not installed, or an option is out of range (one line).
    """
    parser = build_parser()
    if args.min_replicas < 1:
        parser.error(f"argument --min_replicas: an int >= 1, got {args.min_replicas}")
    if not 0 <= args.port < 65536:
        parser.error(f"argument --port: 0..65535, got {args.port}")
    for name in ("join_timeout_ms", "heartbeat_timeout_ms", "quorum_tick_ms"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name}: an int >= 1 (ms), got {getattr(args, name)}")
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        parser.error("torchft is not installed: pip install 'kempnerforge[ft]'")
    server = LighthouseServer(
        bind=f"[::]:{args.port}",
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    address = server.address()
    print(address, flush=True)
    if args.address_file:
        Path(args.address_file).write_text(address + "\n")
    try:
        stop.wait()
    finally:
        server.shutdown()
    return address


def lighthouse_main(argv: list[str] | None = None) -> None:
    """Entry point of ``kforge lighthouse``: serves until SIGINT / SIGTERM, then exits 0."""
    args = build_parser().parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve(args, stop)
    sys.exit(0)
