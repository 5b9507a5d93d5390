"""``kforge estimate``: a recipe's real parallel chain and one training step on a simulated cluster.

``estimate(fit_args, num_nodes, devices)`` builds what ``kforge fit`` builds (LightningModule, DataModule,
KempnerStrategy) on a fake process group of ``num_nodes x devices`` ranks with fake tensors, runs one step
through the module's own loss path and reports per-rank memory, FLOPs, collective bytes and a verdict.
See :mod:`kempnerforge.estimate.run`.

Names are imported on first use, so ``kforge estimate --help`` (and its argument checks) do not import torch.
"""

from kempnerforge.lazy_exports import lazy_exports

_EXPORTS = {
    "Allowance": "allowance",
    "Estimate": "report",
    "RoleEstimate": "report",
    "Suggestion": "report",
    "Verdict": "report",
    "format_text": "report",
    "estimate": "run",
    "simulate_rank": "run",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
