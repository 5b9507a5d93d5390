"""``kforge estimate``: a recipe's real parallel chain and one training step on a simulated cluster.

``estimate(fit_args, num_nodes, devices)`` builds what ``kforge fit`` builds (LightningModule, DataModule,
KempnerStrategy) on a fake process group of ``num_nodes x devices`` ranks with fake tensors, runs one step
through the module's own loss path and reports per-rank memory, FLOPs, collective bytes and a verdict.
See :mod:`kempnerforge.estimate.run`.
"""

from kempnerforge.estimate.report import Estimate, RoleEstimate, Suggestion, Verdict, format_text
from kempnerforge.estimate.run import estimate, simulate_rank

__all__ = ["Estimate", "RoleEstimate", "Suggestion", "Verdict", "estimate", "format_text", "simulate_rank"]
