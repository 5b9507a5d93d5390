"""KempnerStrategy's signal handling: flag-only handlers in every run, and none of Lightning's own.

Lightning 2.6's ``_SignalConnector`` installs a SIGTERM handler that broadcasts over the world inside the signal
handler (and its launcher forwards the signal, so a rank can enter it twice, nested); a rank interrupted inside
another collective deadlocks against it (Lightning issue #20806, PR #20825). Its training loop also broadcasts a
SIGTERM flag and reads it back with ``.item()`` at the start of every step when the world is larger than one.
Under ``KempnerStrategy`` neither runs: :func:`take_over_signals` makes a :class:`~kempnerforge.callbacks.Preemption`
(the configured one, else a default one) the only handler of SIGTERM / SIGUSR1 / SIGINT, and its agreement at
step boundaries replaces the per-step broadcast.
"""

from __future__ import annotations

from typing import Any

from kempnerforge.callbacks.preemption import Preemption

#: Signals the default handler catches (SLURM's SIGTERM and ``--signal=USR1@...``, Ctrl-C).
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


def take_over_signals(trainer: Any) -> Preemption:
    """Make a ``Preemption`` callback the trainer's signal handling, before ``fit`` registers Lightning's.

    Adds ``Preemption(signals=DEFAULT_SIGNALS, save=<a checkpoint callback is configured>)`` when the trainer has
    none (a user's own keeps its settings); replaces ``trainer._signal_connector.register_signal_handlers`` (called
    by ``Trainer._run`` after the restore) with the flag's ``install``; and turns off the training epoch loop's
    per-step ``_broadcast_sigterm_tensor``. Idempotent (``validate`` / ``test`` after ``fit`` call it again).
    Both patched names are private Lightning 2.6 attributes (no public API replaces the signal handling);
    ``tests/unit/test_preemption_signals.py`` fails when a Lightning upgrade renames them.

    Args:
        trainer: the ``lightning.pytorch.Trainer`` running with this strategy.

    Returns:
        The ``Preemption`` callback in charge.
    """
    found = [cb for cb in trainer.callbacks if isinstance(cb, Preemption)]
    if found:
        preemption = found[0]
    else:
        preemption = Preemption(signals=DEFAULT_SIGNALS, save=trainer.checkpoint_callback is not None)
        trainer.callbacks.append(preemption)
    connector = trainer._signal_connector
    if not getattr(connector, "_kforge_taken_over", False):
        connector.register_signal_handlers = _installer(connector, preemption)
        connector._kforge_taken_over = True
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop._broadcast_sigterm_tensor = _agreed_at_step_boundaries
    return preemption


def _installer(connector: Any, preemption: Preemption) -> Any:
    def register_signal_handlers() -> None:
        # What Lightning's method resets, without its handlers: the flag-only one is installed instead.
        connector.received_sigterm = False
        preemption.flag.install()

    return register_signal_handlers


def _agreed_at_step_boundaries() -> None:
    """Stands in for Lightning's per-step SIGTERM broadcast: ``Preemption`` agrees on the flag instead (inside
    NaNGuard's per-step reduction, or every ``check_every_s`` seconds)."""
