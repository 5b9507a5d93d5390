"""Resilience logic behind the callbacks: signal flags, cross-rank agreement, SLURM requeue, watchdog, auto-resume."""
