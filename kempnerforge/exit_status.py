"""The exit statuses of ``kforge`` commands: what a scheduler, a script or a person can tell apart.

A job script reads ``$?`` to decide what happened: done (nothing to do), stopped early (run the same command
again to continue), requeued (SLURM already put the job back), diverged (do not resubmit: change the config),
a user error (nothing ran) or a crash. The values follow ``sysexits.h`` where one fits (``EX_TEMPFAIL`` = 75,
"try again later", for a run that stopped early with its state saved).
"""

from __future__ import annotations

#: The command finished what it was asked to do (``fit``: ``trainer.max_steps`` / ``max_epochs`` reached).
SUCCESS = 0

#: An uncaught exception: a crash (Python's own status for a traceback).
CRASH = 1

#: A user error, printed as one line ``kforge: error: <field>: <what is allowed>``; nothing ran or was written.
USAGE = 2

#: Training stopped because the loss or the gradients stayed non-finite (NaN guard); no non-finite checkpoint
#: was written. Resubmitting the same config reproduces it: change the learning rate, data or precision.
DIVERGED = 3

#: Training stopped early on a signal (SIGTERM, SIGUSR1, SIGINT) after all ranks agreed at a step boundary; the
#: checkpoint written then (if a checkpoint callback is configured) continues it with the same command.
STOPPED_EARLY = 75

#: As :data:`STOPPED_EARLY`, and ``scontrol requeue`` succeeded: SLURM runs the job again by itself.
REQUEUED = 76
