"""LightningModules: ``CausalLM`` (decoder LLM pretraining).

The module owns the loss, the optimizer and the metrics; parallelism, materialization and
checkpoints belong to the strategy (``kempnerforge.strategies.KempnerStrategy``). It also runs under
any stock Lightning strategy (single device, DDP), where ``configure_model`` initializes weights.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch.distributed.tensor import DTensor
from torchmetrics.aggregation import MeanMetric
from torchmetrics.text import Perplexity

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.parallel.dtensor import to_full
from kempnerforge.parallel.expert_parallel import validate_ep
from kempnerforge.parallel.grad_clip import clip_grad_norm_
from kempnerforge.parallel.mesh import MeshConfigError, ParallelDims
from kempnerforge.parallel.tensor_parallel import validate_tp
from kempnerforge.training.loss import (
    IGNORE_INDEX,
    StepTokenNormalizer,
    loss_parallel_context,
    token_cross_entropy_sum,
)
from kempnerforge.training.lr import SchedulerConfig, build_scheduler
from kempnerforge.training.moe_balance import MoEStepTracker
from kempnerforge.training.optim import OptimizerConfig, build_adamw


class CausalLM(LightningModule):
    """Next-token-prediction training of a Llama-style decoder.

    Batches are dicts with ``input_ids`` and ``labels``, both ``LongTensor (batch, seq)``; labels equal
    to -100 are ignored. The loss is the mean cross-entropy over every target token of the global
    batch (all data-parallel ranks), so the result does not depend on how the batch is split.

    Args:
        config: model architecture (``--model.config.*``).
        optimizer: AdamW settings (``--model.optimizer.*``).
        scheduler: warmup + decay LR schedule (``--model.scheduler.*``).
        grad_clip: max global L2 norm of the gradients (0 disables clipping; the norm is still logged).
        init_seed: seed of the weight init; the same seed gives the same weights on every mesh.
        loss_chunk_size: 0 computes the full ``(batch, seq, vocab)`` logits and then the loss; N > 0
            fuses the output head and cross-entropy over chunks of N tokens so the full fp32 logits
            never exist (:mod:`kempnerforge.training.chunked_ce`; same value and gradient). Not with
            ``tp > 1`` (loss parallel already keeps each rank's logits vocab-sharded).

    Raises:
        ValueError: ``grad_clip`` < 0 or ``loss_chunk_size`` < 0 (configs validate their own fields).
        MeshConfigError: ``loss_chunk_size > 0`` with ``tp > 1`` (in :meth:`validate_parallel`).
    """

    def __init__(
        self,
        config: ModelConfig = ModelConfig(),  # noqa: B008 - frozen-by-convention defaults, shown by --help
        optimizer: OptimizerConfig = OptimizerConfig(),  # noqa: B008
        scheduler: SchedulerConfig = SchedulerConfig(),  # noqa: B008
        grad_clip: float = 1.0,
        init_seed: int = 0,
        loss_chunk_size: int = 0,
    ) -> None:
        super().__init__()
        if grad_clip < 0:
            raise ValueError(f"grad_clip={grad_clip} must be >= 0 (0 disables clipping).")
        if loss_chunk_size < 0:
            raise ValueError(f"loss_chunk_size={loss_chunk_size} must be >= 0 (0: full logits, N: chunks of N tokens).")
        self.loss_chunk_size = loss_chunk_size
        self.config = config
        self.optimizer_config = optimizer
        self.scheduler_config = scheduler
        self.grad_clip = grad_clip
        self.init_seed = init_seed
        # Plain dicts, so the checkpoint's metadata loads with weights_only=True.
        self.save_hyperparameters(
            {
                "config": asdict(self.config),
                "optimizer": asdict(self.optimizer_config),
                "scheduler": asdict(self.scheduler_config),
                "grad_clip": grad_clip,
                "init_seed": init_seed,
                "loss_chunk_size": loss_chunk_size,
            }
        )
        self.model: Transformer | None = None
        self.val_loss = MeanMetric()
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.tokens_seen = 0
        # Normalization by the global target-token count of the whole optimizer step (dp ranks x
        # accumulated micro-batches); see StepTokenNormalizer.
        self._step_tokens = StepTokenNormalizer()
        self._loss_parallel_backward = False
        # MoE auxiliary losses, aux-loss-free bias updates and expert-load logs (no-op for dense models).
        self._moe = MoEStepTracker()

    # -- model ----------------------------------------------------------------------------------

    def validate_parallel(self, dims: ParallelDims) -> None:
        """Model-specific mesh rules, called by the strategy before anything is allocated.

        Raises:
            MeshConfigError: ``n_heads`` or ``n_kv_heads`` not divisible by ``tp``
                (:func:`kempnerforge.parallel.tensor_parallel.validate_tp`); ``tp > 1`` with MoE layers
                (the TP plan covers dense feed-forwards only); ``loss_chunk_size > 0`` with ``tp > 1``.
            ValueError: ``ep > 1`` without MoE or ``num_experts`` not divisible by ``ep``
                (:func:`kempnerforge.parallel.expert_parallel.validate_ep`).
        """
        cfg = self.config
        validate_tp(dims.tp, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads_resolved)
        validate_ep(dims.ep, cfg.num_experts)
        if dims.tp > 1 and cfg.num_experts > 0:
            raise MeshConfigError(
                f"tp={dims.tp} with num_experts={cfg.num_experts} is not supported: the tensor-parallel plan "
                "covers dense feed-forwards only; use tp=1 for MoE models."
            )
        if self.loss_chunk_size and dims.tp > 1:
            raise MeshConfigError(
                f"model.loss_chunk_size={self.loss_chunk_size} needs tp=1 (got tp={dims.tp}): with tensor "
                "parallelism the head is vocab-sharded and loss_parallel already avoids full logits; set "
                "model.loss_chunk_size=0."
            )

    def setup(self, stage: str) -> None:
        """Check the data against the model before the model is built.

        Raises:
            ValueError: the datamodule's ``seq_len`` exceeds ``config.max_seq_len``.
        """
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        seq_len = getattr(datamodule, "seq_len", None)
        if seq_len is not None and seq_len > self.config.max_seq_len:
            raise ValueError(
                f"data.seq_len={seq_len} exceeds model.config.max_seq_len={self.config.max_seq_len}: "
                "raise max_seq_len (RoPE tables cover max_seq_len positions) or shorten seq_len."
            )

    def configure_model(self) -> None:
        """Build the model once (on meta under KempnerStrategy); idempotent for fit-then-validate."""
        if self.model is not None:
            return
        self.model = Transformer(self.config)
        if not any(p.is_meta for p in self.model.parameters()):
            # A stock strategy built real tensors: initialize here (KempnerStrategy does it after sharding).
            with torch.no_grad():
                self.model.init_weights(seed=self.init_seed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab_size)`` for ``input_ids`` ``(batch, seq)``, always a plain tensor
        (vocab-sharded tensor-parallel logits are all-gathered)."""
        logits = self.model(input_ids)
        return to_full(logits)

    # -- steps ----------------------------------------------------------------------------------

    def _dp_group(self) -> dist.ProcessGroup | None:
        mesh = getattr(self.trainer.strategy, "parallel_mesh", None) if self._trainer is not None else None
        if mesh is not None:
            return mesh.dp.get_group()
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """One micro-batch: summed token cross-entropy (normalized per optimizer step in
        :meth:`on_before_optimizer_step`); logs lr and tokens seen (tokens/s and MFU: the
        :class:`~kempnerforge.callbacks.MFUMonitor` callback)."""
        if self.loss_chunk_size:
            labels = batch["labels"]
            loss_sum = self.model(batch["input_ids"], labels=labels, loss_chunk_size=self.loss_chunk_size)
            return self._record_step(batch, batch_idx, loss_sum, (labels != IGNORE_INDEX).sum())
        logits = self.model(batch["input_ids"])
        # Vocab-sharded logits (TP with loss parallel): the backward must also run under loss_parallel().
        self._loss_parallel_backward = isinstance(logits, DTensor)
        # Un-normalized: on_before_optimizer_step divides the step's gradients by its global target-token
        # count (all micro-batches, all dp ranks) and logs train/loss.
        loss_sum, n_targets = token_cross_entropy_sum(logits, batch["labels"])
        return self._record_step(batch, batch_idx, loss_sum, n_targets)

    def _record_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, loss_sum: torch.Tensor, n_targets: torch.Tensor
    ) -> torch.Tensor:
        new_step = batch_idx % self.trainer.accumulate_grad_batches == 0
        loss = self._step_tokens.add(loss_sum, n_targets, self._dp_size(), new_step)
        loss = self._add_moe_aux_loss(loss, n_targets, new_step)
        tokens = batch["input_ids"].numel() * self._dp_size()
        self.tokens_seen += tokens
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], rank_zero_only=True)
        self.log("train/tokens_seen", float(self.tokens_seen), rank_zero_only=True)
        return loss

    def _add_moe_aux_loss(self, loss: torch.Tensor, n_targets: torch.Tensor, new_step: bool) -> torch.Tensor:
        """Add the MoE layers' weighted auxiliary losses (dense model: ``loss`` unchanged).

        ``loss`` is later multiplied by ``accumulate / N_global`` through the gradients and averaged
        over dp ranks, so the aux loss enters as ``aux * n_targets * dp_size``: the step optimizes the
        target-token-weighted mean of the micro-batches' aux losses. Logged as ``train/moe_aux_loss``.
        """
        aux = self._moe.collect(self.model, new_step)
        if aux is None:
            return loss
        self.log("train/moe_aux_loss", aux.detach(), rank_zero_only=True)
        return loss + aux * n_targets.to(aux.dtype) * self._dp_size()

    def _dp_size(self) -> int:
        group = self._dp_group()
        return dist.get_world_size(group) if group is not None else 1

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the trained model at ``seq_len`` (what MFU counts), FLOP/token.

        The decoder's :meth:`ModelConfig.flops_per_token`; a module with more trained parts (a VLM's
        encoder and connector) adds their terms (:func:`kempnerforge.metrics.flops.sum_flops_per_token`).
        """
        return self.config.flops_per_token(seq_len)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``, under ``loss_parallel()`` when the step's logits were vocab-sharded.

        Lightning runs the backward outside ``training_step``; the vocab-parallel cross-entropy's
        backward (``torch.distributed.tensor.parallel.loss_parallel``) is only correct and
        communication-free inside that context, so it is entered here too.
        """
        with loss_parallel_context(self._loss_parallel_backward):
            super().backward(loss, *args, **kwargs)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Accumulate token-weighted loss and perplexity (synced across ranks by torchmetrics)."""
        logits = self(batch["input_ids"]).float()
        labels = batch["labels"]
        n = (labels != IGNORE_INDEX).sum()
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        self.val_loss.update(loss / n.clamp(min=1), weight=n)
        self.val_ppl.update(logits, labels)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl)

    # -- optimization ---------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (no decay on norms, biases, embeddings) with a per-step warmup + decay schedule."""
        optimizer = build_adamw(self.model, self.optimizer_config)
        total = self.scheduler_config.total_steps or self.trainer.max_steps
        if total is None or total < 1:
            total = max(1, self.trainer.estimated_stepping_batches)
        scheduler = build_scheduler(optimizer, self.scheduler_config, int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the step's gradients by its global target-token count and log the step loss
        (``train/loss``, mean per target token of the global batch), then clip to ``grad_clip`` by the
        true global norm (DTensor-aware) and log that norm."""
        global_loss, _, scale = self._step_tokens.finish(self._dp_group(), self.trainer.accumulate_grad_batches)
        self.log("train/loss", global_loss, prog_bar=True, rank_zero_only=True)
        # The token normalization rides on the clipping multiply: one pass over the gradients.
        pp_group = getattr(self.trainer.strategy, "pp_group", None)  # pipeline stages: norm over all of them
        norm = clip_grad_norm_(self.model.parameters(), self.grad_clip, grad_scale=scale, pp_group=pp_group)
        self.log("train/grad_norm", norm, rank_zero_only=True)
        self._moe_step()

    def _moe_step(self) -> None:
        """MoE only: the once-per-optimizer-step router bias update (DeepSeek-V3 aux-loss-free
        balancing) and, at the trainer's log interval, the per-layer expert-load metrics."""
        self._moe.finish_step(self.model, self._dp_group(), self.config.bias_update_rate)
        every = max(1, self.trainer.log_every_n_steps)
        if self.config.num_experts > 0 and (self.trainer.global_step + 1) % every == 0:
            for name, value in self._moe.metrics(self.model).items():
                self.log(name, value, rank_zero_only=True)

    # -- checkpoint extras ----------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the token counter in the checkpoint so ``tokens_seen`` continues after resume."""
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore ``tokens_seen``."""
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
