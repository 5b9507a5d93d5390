"""Tokens/s and MFU (model FLOPs utilization) over windows of steps, without per-step device syncs."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from kempnerforge.callbacks._util import batch_tokens, data_parallel_size
from kempnerforge.metrics.flops import mfu
from kempnerforge.metrics.peak import device_peak_flops, peak_cache_path


def _is_fp8(module: torch.nn.Module) -> bool:
    # torchao's converted layers are Float8Linear (and friends); any of them makes this an FP8 run.
    return any(type(m).__name__.startswith("Float8") for m in module.modules())


class MFUMonitor(Callback):
    """Logs ``train/tokens_per_s`` (global), ``train/tokens_per_s_per_device`` and ``train/mfu``.

    Time is read on the host at the end of every ``window``-th step (one ``torch.cuda.synchronize``
    per window on CUDA, none per step), so a window's tokens/s averages over its steps. Tokens are
    counted from the batch shape on the host (``batch["input_ids"]`` or the first tensor of the
    batch). Per device = global / world size = local tokens / (world size / data-parallel size):
    ranks of one data shard (TP, CP) see the same tokens and are not counted twice.

    MFU = tokens/s per device * FLOP/token / peak FLOP/s per device (PaLM, arXiv:2204.02311,
    appendix B). FLOP/token comes from ``flops_per_token`` if given, else the module's
    ``flops_per_token(seq_len)`` method, else its ``config.flops_per_token(seq_len)``
    (:meth:`kempnerforge.config.ModelConfig.flops_per_token`); without any, only tokens/s are
    logged. The peak is ``peak_flops`` if given, else the dense bf16 datasheet figure of the GPU
    (:data:`kempnerforge.metrics.peak.GPU_PEAK_BF16_FLOPS`) or, on CPU, an fp32 matmul peak: the highest
    measured on the machine, cached (:func:`kempnerforge.metrics.peak.cpu_peak_flops`).
    When the model has FP8 (``Float8*``) layers, MFU is omitted unless ``peak_flops`` is given
    (a bf16 peak would overstate it); it is then logged as ``train/mfu_fp8``.

    Args:
        window: training batches per measurement (micro-batches under gradient accumulation); None uses
            ``trainer.log_every_n_steps`` (1 under ``fast_dev_run``).
        flops_per_token: training FLOPs per token (forward + backward), FLOP/token.
        peak_flops: peak FLOP/s of one device (overrides the table / CPU measurement).
        sync_cuda: synchronize CUDA once per window so the window's time includes its queued kernels.

    Raises:
        ValueError: ``window`` < 1, or ``flops_per_token`` / ``peak_flops`` not positive.
    """

    def __init__(
        self,
        window: int | None = None,
        flops_per_token: int | None = None,
        peak_flops: float | None = None,
        sync_cuda: bool = True,
    ) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"MFUMonitor.window={window!r} must be an integer >= 1 or None")
        if flops_per_token is not None and not flops_per_token > 0:
            raise ValueError(f"MFUMonitor.flops_per_token={flops_per_token!r} must be > 0 or None")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"MFUMonitor.peak_flops={peak_flops!r} must be > 0 (FLOP/s per device) or None")
        self.window = window
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.sync_cuda = sync_cuda
        self.last: dict[str, float] = {}
        self._reset_window()

    def _reset_window(self) -> None:
        self._t0: float | None = None
        self._tokens = 0
        self._steps = 0
        self._seq_len: int | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve the window, the parallel degrees, FP8 and the device peak (once)."""
        # fast_dev_run keeps log_every_n_steps (50) but runs a step or a few: measure every step there.
        self._window = 1 if trainer.fast_dev_run else self.window or max(1, trainer.log_every_n_steps)
        self._dp = data_parallel_size(trainer)
        self._non_dp = max(1, trainer.world_size // self._dp)
        self._fp8 = _is_fp8(pl_module)
        self._peak = None
        if self._fp8 and self.peak_flops is None:
            rank_zero_warn("MFUMonitor: FP8 layers found and no peak_flops given: MFU is omitted (tokens/s only).")
        else:
            self._peak = device_peak_flops(trainer.strategy.root_device, self.peak_flops)
            if self._peak is None:
                rank_zero_warn(
                    f"MFUMonitor: no peak FLOP/s known for {trainer.strategy.root_device}: pass peak_flops to log MFU."
                )
            else:
                rank_zero_info(
                    f"MFUMonitor: peak {self._peak / 1e12:.3f} TFLOP/s per device ({self._peak_source(trainer)})"
                )
        self._reset_window()

    def _peak_source(self, trainer: Trainer) -> str:
        device = trainer.strategy.root_device
        if self.peak_flops is not None:
            return "peak_flops"
        if device.type == "cuda":
            return f"dense bf16 datasheet figure of {torch.cuda.get_device_name(device)}"
        return f"fp32 matmul, the highest measured on this machine, cached in {peak_cache_path()}"

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Start the first window's clock at the first batch (data-loader start-up is not counted)."""
        if self._t0 is None:
            self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count this step's tokens; at the window's end, read the clock and log."""
        tokens = batch_tokens(batch)
        if tokens is not None:
            self._tokens += tokens.numel()
            self._seq_len = tokens.shape[-1] if tokens.dim() > 1 else None
        self._steps += 1
        if self._steps < self._window or self._t0 is None:
            return
        if self.sync_cuda and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        now = time.perf_counter()
        self._log(pl_module, self._tokens / (now - self._t0))
        self._t0, self._tokens, self._steps = now, 0, 0

    def _flops_per_token(self, pl_module: LightningModule) -> int | None:
        if self.flops_per_token is not None:
            return self.flops_per_token
        if self._seq_len is None:
            return None
        fn = getattr(pl_module, "flops_per_token", None)
        if not callable(fn):
            fn = getattr(getattr(pl_module, "config", None), "flops_per_token", None)
        return fn(self._seq_len) if callable(fn) else None

    def _log(self, pl_module: LightningModule, local_tokens_per_s: float) -> None:
        per_device = local_tokens_per_s / self._non_dp
        self.last = {"tokens_per_s": local_tokens_per_s * self._dp, "tokens_per_s_per_device": per_device}
        fpt = self._flops_per_token(pl_module)
        if self._peak is not None and fpt is not None:
            self.last["mfu_fp8" if self._fp8 else "mfu"] = mfu(per_device, fpt, self._peak)
        for key, value in self.last.items():
            # tokens/s and MFU next to the loss in the progress bar; the per-device rate in the logs only
            bar = key in ("tokens_per_s", "mfu", "mfu_fp8")
            # A host tensor: Lightning would copy a Python float to the device (a blocking copy on CUDA).
            host = torch.tensor(float(value), dtype=torch.float64)
            pl_module.log(f"train/{key}", host, on_step=True, on_epoch=False, prog_bar=bar, rank_zero_only=True)
