"""LightningModules: ``CausalLM`` (decoder LLM pretraining) and ``VisionLanguage`` (VLM training).

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
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.tensor import DTensor
from torchmetrics.aggregation import MeanMetric
from typing_extensions import override

from kempnerforge.callbacks.freeze import FreezeSchedule
from kempnerforge.config import ModelConfig
from kempnerforge.config.vision import ConnectorConfig, VisionEncoderConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.errors import UserError
from kempnerforge.metrics.perplexity import ExpMeanMetric
from kempnerforge.model import Transformer
from kempnerforge.model.connectors import connector_tokens
from kempnerforge.model.fused import validate_fused_tp
from kempnerforge.model.vision import build_image_processor, hf_vision_config
from kempnerforge.model.vlm import build_backbone
from kempnerforge.model.vlm.model import VisionLanguageModel
from kempnerforge.parallel.context_parallel import shard_batch
from kempnerforge.parallel.dtensor import to_full
from kempnerforge.parallel.expert_parallel import validate_ep
from kempnerforge.parallel.grad_clip import check_lightning_clipping, clip_grad_norm_
from kempnerforge.parallel.mesh import MeshConfigError, ParallelDims
from kempnerforge.parallel.tensor_parallel import validate_tp
from kempnerforge.training.freeze import FreezeSpec, apply_freeze, ever_trainable, init_adamw_state
from kempnerforge.training.loss import (
    IGNORE_INDEX,
    StepTokenNormalizer,
    loss_parallel_context,
    token_cross_entropy_sum,
    z_loss_sum,
)
from kempnerforge.training.loss_impl import FUSED_IMPLS, resolve_loss_impl, validate_loss_impl
from kempnerforge.training.lr import SchedulerConfig, build_scheduler
from kempnerforge.training.moe_balance import MoEStepTracker
from kempnerforge.training.optimizers import (
    OptimizerConfig,
    build_optimizer,
    check_optimizer_model,
    check_optimizer_schedule,
    set_schedule_free_mode,
)
from kempnerforge.training.resume_overrides import apply_optimizer_overrides


def _has_trainer(module: LightningModule) -> bool:
    """Whether ``module`` is attached to a Trainer (Lightning's public ``trainer`` property raises
    ``RuntimeError`` when it is not, e.g. in a module built and called outside ``fit``)."""
    try:
        return module.trainer is not None
    except RuntimeError:
        return False


class CausalLM(LightningModule):
    """Next-token-prediction training of a Llama-style decoder.

    Batches are dicts with ``input_ids`` and ``labels``, both ``LongTensor (batch, seq)``; labels equal
    to -100 are ignored. The loss is the mean cross-entropy over every target token of the global
    batch (all data-parallel ranks), so the result does not depend on how the batch is split.

    Args:
        config: model architecture (``--model.config.*``).
        optimizer: AdamW settings (``--model.optimizer.*``).
        scheduler: warmup + decay LR schedule (``--model.scheduler.*``).
        grad_clip: max global L2 norm of the gradients (0 disables clipping; the norm is still logged). The
            only clipping: Lightning's ``trainer.gradient_clip_val`` is refused (:meth:`configure_gradient_clipping`).
        init_seed: seed of the weight init; the same seed gives the same weights on every mesh.
        loss_chunk_size: tokens per chunk of the fused head + cross-entropy (``loss_impl`` chunked; 0: the
            default size, :func:`~kempnerforge.training.chunked_ce.default_chunk_size`); N > 0 also selects the
            chunked path under ``loss_impl=auto``. Not with ``tp > 1`` (loss parallel already keeps each rank's
            logits vocab-sharded) or ``pp > 1``.
        z_loss_weight: weight of the z-loss ``logsumexp(logits)^2`` per target token (PaLM,
            arXiv:2204.02311 sec. 5; PaLM used 1e-4), on the same global-token normalization as the
            cross-entropy; logged as ``train/z_loss`` (mean per token). 0 disables it.
        init_from: fine-tune from a Hugging Face ``save_pretrained`` folder (local; nothing is downloaded): the
            architecture comes from its ``config.json`` (``--model.config.*`` may only add training-only fields or
            a shorter ``max_seq_len``; a conflicting value is refused), the weights are read into the sharded model
            at ``init_weights``, each rank reading only its shard, and the optimizer and LR schedule start fresh
            (:mod:`kempnerforge.checkpoint.init_from`). The data's tokenizer defaults to the same folder. Like
            litgpt's ``--initial_checkpoint_dir``. None: random init.
        loss_impl: how the head + cross-entropy is computed (:mod:`kempnerforge.training.loss_impl`): ``auto``
            (default: ``chunked`` with tp=1 and pp=1, else ``torch``), ``torch`` (full logits, then the
            cross-entropy; vocab-parallel with TP), ``chunked`` (the head fused with the loss over token chunks:
            no logits-sized tensor; same value and gradients) or ``liger`` (Liger-Kernel on CUDA, the ``gpu``
            extra; 2 host syncs per micro-batch of its own).

    Raises:
        ValueError: ``grad_clip``, ``loss_chunk_size`` or ``z_loss_weight`` < 0 (configs validate their own fields);
            ``loss_impl`` not one of the above, or ``loss_chunk_size > 0`` with ``torch`` / ``liger``;
            ``schedule_free_adamw`` with a decaying LR schedule.
        UserError: ``init_from`` missing, without ``config.json``, of an unsupported architecture, or a
            ``model.config`` field that conflicts with it.
        MeshConfigError: ``loss_chunk_size > 0`` or a fused ``loss_impl`` with ``tp > 1`` or ``pp > 1`` (in
            :meth:`validate_parallel`).
    """

    #: Whether the model can compute its loss from its hidden states (the fused head + loss paths).
    fused_head: bool = True
    #: True, or why ``cp > 1`` is refused (:func:`~kempnerforge.parallel.context_parallel.validate_cp_run`).
    supports_context_parallel: bool | str = True

    def __init__(
        self,
        config: ModelConfig = ModelConfig(),  # noqa: B008 - frozen-by-convention defaults, shown by --help
        optimizer: OptimizerConfig = OptimizerConfig(),  # noqa: B008
        scheduler: SchedulerConfig = SchedulerConfig(),  # noqa: B008
        grad_clip: float = 1.0,
        init_seed: int = 0,
        loss_chunk_size: int = 0,
        z_loss_weight: float = 0.0,
        init_from: str | None = None,
        loss_impl: str = "auto",
    ) -> None:
        super().__init__()
        if init_from is not None:  # before anything else: the architecture is the checkpoint's
            from kempnerforge.checkpoint.init_from import resolve_model_config

            config = resolve_model_config(init_from, config)
        self.init_from = init_from
        if grad_clip < 0:
            raise ValueError(f"grad_clip={grad_clip} must be >= 0 (0 disables clipping).")
        if z_loss_weight < 0:
            raise ValueError(f"z_loss_weight={z_loss_weight} must be >= 0 (PaLM uses 1e-4; 0 disables it).")
        self.z_loss_weight = z_loss_weight
        validate_loss_impl(loss_impl, loss_chunk_size)
        check_optimizer_schedule(optimizer, scheduler)
        check_optimizer_model(optimizer, config)
        self.loss_chunk_size = loss_chunk_size
        self.loss_impl = loss_impl
        # Resolved again by validate_parallel with the mesh's tp / pp (a stock strategy: one process, no TP).
        self.resolved_loss_impl = resolve_loss_impl(loss_impl, loss_chunk_size, fused_ok=self.fused_head)
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
                "z_loss_weight": z_loss_weight,
                "init_from": init_from,
                "loss_impl": loss_impl,
            }
        )
        self.model: Transformer | None = None
        self.val_loss = MeanMetric()
        self.val_ppl = ExpMeanMetric()  # exp(val/loss) from the same updates: no second softmax
        self.tokens_seen = 0
        self.last_step_tokens = 0  # the last micro-batch's share of tokens_seen
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
                (:func:`kempnerforge.parallel.tensor_parallel.validate_tp`); ``loss_chunk_size > 0`` or a fused
                ``loss_impl`` with ``tp > 1`` or ``pp > 1`` (:func:`~kempnerforge.training.loss_impl.resolve_loss_impl`);
                ``fuse_w13`` with ``tp`` not dividing ``ffn_hidden`` (:func:`kempnerforge.model.fused.validate_fused_tp`).
            ValueError: ``ep > 1`` without MoE or ``num_experts`` not divisible by ``ep``
                (:func:`kempnerforge.parallel.expert_parallel.validate_ep`).
            MeshConfigError: ``cp > 1`` with MoE's sequence-wise aux loss (``seq_aux_loss_weight > 0``).
        """
        cfg = self.config
        validate_tp(dims.tp, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads_resolved)
        validate_fused_tp(cfg, dims.tp)
        validate_ep(dims.ep, cfg.num_experts)
        if dims.cp > 1 and cfg.num_experts and cfg.seq_aux_loss_weight > 0:
            raise MeshConfigError(
                f"cp={dims.cp} with model.config.seq_aux_loss_weight={cfg.seq_aux_loss_weight} is not supported yet: "
                "the sequence-wise balance loss is a statistic of whole sequences, which cp splits; use "
                "seq_aux_loss_weight=0 (bias balancing and aux_loss_weight work under cp)."
            )
        self.resolved_loss_impl = resolve_loss_impl(
            self.loss_impl, self.loss_chunk_size, tp=dims.tp, pp=dims.pp, fused_ok=self.fused_head
        )

    @override
    def setup(self, stage: str) -> None:
        """Check the data against the model before the model is built (:meth:`check_data`)."""
        self.check_data(getattr(self.trainer, "datamodule", None) if _has_trainer(self) else None)

    def check_data(self, datamodule: Any) -> None:
        """The data's lengths against the model's, from the configs alone (``kforge`` runs it before any
        process group exists, :mod:`kempnerforge.preflight`; :meth:`setup` again in ``fit``).

        Raises:
            ValueError: the datamodule's ``seq_len`` exceeds ``config.max_seq_len`` (a UserError naming
                ``data.seq_len`` under ``init_from``, whose folder fixes the ceiling).
        """
        seq_len = getattr(datamodule, "seq_len", None)
        if seq_len is not None and seq_len > self.config.max_seq_len:
            if getattr(self, "init_from", None) is not None:  # the folder's max_position_embeddings is the ceiling
                raise UserError(
                    "data.seq_len",
                    f"data.seq_len={seq_len} exceeds {self.config.max_seq_len}, the max_position_embeddings of "
                    f"model.init_from={self.init_from} (its RoPE was trained that far; max_seq_len cannot go beyond "
                    f"it): use data.seq_len <= {self.config.max_seq_len}.",
                )
            raise ValueError(
                f"data.seq_len={seq_len} exceeds model.config.max_seq_len={self.config.max_seq_len}: "
                "raise max_seq_len (RoPE tables cover max_seq_len positions) or shorten seq_len."
            )

    @override
    def configure_model(self) -> None:
        """Build the model once (on meta under KempnerStrategy); idempotent for fit-then-validate."""
        if self.model is not None:
            return
        self.model = Transformer(self.config, init_from=self.init_from)
        if not any(p.is_meta for p in self.model.parameters()):
            # A stock strategy built real tensors: initialize here (KempnerStrategy does it after sharding).
            with torch.no_grad():
                self.model.init_weights(seed=self.init_seed)

    @override
    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab_size)`` for ``input_ids`` ``(batch, seq)``, always a plain tensor
        (vocab-sharded tensor-parallel logits are all-gathered); ``doc_ids`` (batch, seq) masks
        attention per packed document."""
        logits = self.model(input_ids, doc_ids=doc_ids)
        return to_full(logits)

    # -- steps ----------------------------------------------------------------------------------

    def _parallel_mesh(self):
        return getattr(self.trainer.strategy, "parallel_mesh", None) if _has_trainer(self) else None

    def _dp_group(self) -> dist.ProcessGroup | None:
        """The group the step's target tokens are counted and its gradients averaged over: every rank that saw
        other tokens (data shards x context-parallel ranks, ``ParallelMesh.dp_cp``); the world without our mesh."""
        mesh = self._parallel_mesh()
        if mesh is not None:
            return mesh.dp_cp.get_group()
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def _cp_batch(self, batch: dict[str, torch.Tensor]) -> dict:
        """This rank's share of ``batch`` under context parallelism (its ``"cp"`` entry then goes to the model,
        :func:`~kempnerforge.parallel.context_parallel.shard_batch`); ``batch`` itself when ``cp = 1``."""
        mesh = self._parallel_mesh()
        if mesh is None or mesh.dims.cp == 1:
            return batch
        return shard_batch(batch, mesh.cp)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """One micro-batch: token cross-entropy normalized by the optimizer step's global target-token
        count (:meth:`_record_step`); logs lr and tokens seen (tokens/s and MFU: the
        :class:`~kempnerforge.callbacks.MFUMonitor` callback)."""
        full, batch = batch, self._cp_batch(batch)
        labels, w = batch["labels"], self.z_loss_weight
        if self.resolved_loss_impl in FUSED_IMPLS:
            total, z_sum = self._fused_loss(batch, w, self.resolved_loss_impl)
            # z_sum is a constant here: total - w * z_sum has the CE value and total's gradient.
            return self._record_step(full, batch_idx, total - w * z_sum, (labels != IGNORE_INDEX).sum(), z_sum)
        logits = self._logits(batch)
        # Vocab-sharded logits (TP with loss parallel): the backward must also run under loss_parallel().
        self._loss_parallel_backward = isinstance(logits, DTensor)
        # Summed over tokens: _record_step normalizes by the step's global target-token count (all
        # micro-batches, all dp ranks); on_before_optimizer_step logs train/loss.
        loss_sum, n_targets = token_cross_entropy_sum(logits, labels)
        z_sum = z_loss_sum(logits, labels) if w else None
        return self._record_step(full, batch_idx, loss_sum, n_targets, z_sum)

    def _fused_loss(
        self, batch: dict[str, torch.Tensor], z_loss_weight: float, loss_impl: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum + z_loss_weight * z_sum, z_sum)`` of one batch from the head fused with the loss (fp32 scalars,
        nats; ``loss_impl``: ``chunked`` or ``liger``); a subclass feeds more inputs."""
        return self.model(
            batch["input_ids"],
            labels=batch["labels"],
            loss_chunk_size=self.loss_chunk_size,
            z_loss_weight=z_loss_weight,
            doc_ids=batch.get("doc_ids"),
            loss_impl=loss_impl,
            **self._cp_kwargs(batch),
        )

    @staticmethod
    def _cp_kwargs(batch: dict) -> dict:
        return {"cp": batch["cp"]} if "cp" in batch else {}

    def _logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's logits (batch, seq, vocab) for one batch (a subclass feeds more inputs); packed
        batches' ``doc_ids`` mask attention per document; a context-parallel share's ``cp`` entry goes along."""
        return self.model(batch["input_ids"], doc_ids=batch.get("doc_ids"), **self._cp_kwargs(batch))

    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], slice | None]:
        """Under ``pp > 1``: the first stage's inputs for ``batch`` (``(input_ids,)``, (batch, seq) int64) and the
        positions the last stage's head reads (None: every position; a VLM's text positions)."""
        return (batch["input_ids"],), None

    def _record_step(
        self,
        batch: dict[str, torch.Tensor],
        batch_idx: int,
        loss_sum: torch.Tensor,
        n_targets: torch.Tensor,
        z_sum: torch.Tensor | None = None,
        moe_aux_in_backward: bool = False,
    ) -> torch.Tensor:
        """Register one micro-batch's CE sum (``train/loss`` logs it) and return what to backpropagate:
        CE plus the weighted z-loss and MoE aux losses, all on the same global-token normalization
        (:class:`~kempnerforge.training.loss.StepTokenNormalizer`: divided by the step's global target
        count here without accumulation, by :meth:`optimizer_step` after the last backward with it).
        ``moe_aux_in_backward``: the pipeline already put the stages' MoE aux losses into the backward and
        collected their statistics (:mod:`kempnerforge.parallel.pipeline_aux`), so they are not added here."""
        accumulate = self.trainer.accumulate_grad_batches
        new_step = batch_idx % accumulate == 0
        objective = loss_sum
        if self.z_loss_weight and z_sum is not None:
            objective = objective + self.z_loss_weight * z_sum
            self.log("train/z_loss", z_sum.detach() / n_targets.clamp(min=1), rank_zero_only=True)
        if not moe_aux_in_backward:
            objective = self._add_moe_aux_loss(objective, n_targets, new_step)
        factor = self._step_tokens.add(loss_sum, n_targets, self._dp_size(), new_step, accumulate, self._dp_group())
        # The whole (unsplit) batch on every dp rank: each token counted once, cp ranks of it not again.
        tokens = batch["input_ids"].numel() * self._data_shards()
        groups = getattr(self.trainer.strategy, "replica_groups", None)
        if groups is not None:  # fault tolerance: every group that took part (its quorum was awaited above)
            tokens *= groups.participants
        self.tokens_seen += tokens
        self.last_step_tokens = tokens  # taken back by fault tolerance when the step does not commit
        self._log_host_scalars()
        return objective * factor

    def _log_host_scalars(self) -> None:
        # Host tensors: Lightning turns a Python number into a tensor on the module's device, a blocking
        # host-to-device copy (a stream synchronization on CUDA) per value per step.
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.log("train/lr", torch.tensor(float(lr), dtype=torch.float64), rank_zero_only=True)
        self.log("train/tokens_seen", torch.tensor(float(self.tokens_seen), dtype=torch.float64), rank_zero_only=True)

    def _add_moe_aux_loss(self, loss: torch.Tensor, n_targets: torch.Tensor, new_step: bool) -> torch.Tensor:
        """Add the MoE layers' weighted auxiliary losses (dense model: ``loss`` unchanged).

        ``loss`` is a sum over target tokens that is later divided by the step's global target count
        (and averaged over dp ranks by FSDP2 with the ``dp_size`` factor), so the aux loss enters as
        ``aux * n_targets``: the step optimizes the target-token-weighted mean of the micro-batches'
        aux losses. Logged as ``train/moe_aux_loss``.
        """
        aux = self._moe.collect(self.model, new_step)
        if aux is None:
            return loss
        self.log("train/moe_aux_loss", aux.detach(), rank_zero_only=True)
        return loss + aux * n_targets.to(aux.dtype)

    def _dp_size(self) -> int:
        """Size of :meth:`_dp_group` (data shards x cp ranks): FSDP2 averages gradients over it."""
        group = self._dp_group()
        return dist.get_world_size(group) if group is not None else 1

    def _data_shards(self) -> int:
        """The number of data shards (distinct batches per micro-step): :meth:`_dp_size` without the cp ranks."""
        mesh = self._parallel_mesh()
        return self._dp_size() // (mesh.dims.cp if mesh is not None else 1)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the trained model at ``seq_len`` (what MFU counts), FLOP/token.

        The decoder's :meth:`ModelConfig.flops_per_token`; a module with more trained parts (a VLM's
        encoder and connector) adds their terms (:func:`kempnerforge.metrics.flops.sum_flops_per_token`).
        """
        return self.config.flops_per_token(seq_len)

    @override
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``, under ``loss_parallel()`` when the step's logits were vocab-sharded.

        Lightning runs the backward outside ``training_step``; the vocab-parallel cross-entropy's
        backward (``torch.distributed.tensor.parallel.loss_parallel``) is only correct and
        communication-free inside that context, so it is entered here too.
        """
        with loss_parallel_context(self._loss_parallel_backward):
            super().backward(loss, *args, **kwargs)

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Token-weighted ``val/loss`` and ``val/ppl = exp(val/loss)`` (synced across ranks by torchmetrics),
        computed by the training loss path (:meth:`_validation_loss_sum`)."""
        self.record_validation(*self._validation_loss_sum(batch))

    def _validation_loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's summed target-token cross-entropy (fp32 scalar, nats) and target count, as training
        computes it: the fused head + loss (chunked, also for ``liger``: no gradient buffers), vocab-parallel on
        sharded TP logits, so validation never holds a vocab-sized tensor a training step did not (no z-loss: it
        is not logged)."""
        batch = self._cp_batch(batch)
        labels = batch["labels"]
        if self.resolved_loss_impl in FUSED_IMPLS:
            loss_sum, _ = self._fused_loss(batch, 0.0, "chunked")
            return loss_sum, (labels != IGNORE_INDEX).sum()
        return token_cross_entropy_sum(self._logits(batch), labels)

    def record_validation(self, loss_sum: torch.Tensor, n_targets: torch.Tensor) -> None:
        """Add one validation batch, ``loss_sum`` (summed token loss, nats) over ``n_targets`` target tokens,
        to ``val/loss`` and ``val/ppl`` and log them (the pipeline path calls this with the last stage's loss)."""
        n = n_targets.to(torch.float32)
        mean = loss_sum.detach().float() / n.clamp(min=1)
        self.val_loss.update(mean, weight=n)
        self.val_ppl.update(mean, weight=n)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl)

    @override
    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        """No Lightning clipping: :meth:`on_before_optimizer_step` already clipped to ``grad_clip`` by the true
        global norm; ``trainer.gradient_clip_val`` is refused (also before rendezvous by KempnerStrategy and
        the CLI) rather than clipping a second time.

        Raises:
            ValueError: ``trainer.gradient_clip_val`` set (not None or 0).
        """
        check_lightning_clipping(gradient_clip_val)

    # -- optimization ---------------------------------------------------------------------------

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """The configured optimizer (:func:`~kempnerforge.training.optimizers.build_optimizer`; no decay
        on norms, biases, embeddings; frozen parameters left out) with a per-step warmup + decay schedule."""
        optimizer = build_optimizer(self.model, self.optimizer_config)
        total = self.scheduler_config.total_steps or self.trainer.max_steps
        if total is None or total < 1:
            total = max(1, self.trainer.estimated_stepping_batches)
        # A data mixture's annealing phases scale the LR from their step on (a pure function of the step).
        lr_scale = getattr(getattr(self.trainer, "datamodule", None), "lr_scale", None)
        scheduler = build_scheduler(optimizer, self.scheduler_config, int(total), lr_scale)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Lightning's optimizer step, with the step's gradients normalized by its global target-token
        count right after the closure's last backward, so every callback's ``on_before_optimizer_step``
        (which Lightning runs before the module's) sees the gradients of the logged ``train/loss``."""
        if optimizer_closure is None:
            optimizer.step()
            return

        def closure() -> Any:
            out = optimizer_closure()
            self._finish_step_gradients()
            return out

        optimizer.step(closure=closure)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Free the last step's gradients before this step's forward, as torchtitan's loop does (its ``zero_grad``
        opens the step): Lightning's own ``zero_grad`` runs after ``training_step``, so every forward would hold the
        last step's gradient shards (4 GB per rank for llama3_8b at 1 x 8), a peak ``kforge estimate`` does not
        simulate. Only at the first micro-batch of an accumulation window (Lightning's rule); callbacks still see the
        gradients up to ``on_train_batch_end`` of the step that made them."""
        if batch_idx % self.trainer.accumulate_grad_batches == 0:
            for optimizer in self.trainer.optimizers:
                optimizer.zero_grad(set_to_none=True)

    def _finish_step_gradients(self) -> None:
        # With gradient accumulation, the one pass that divides the accumulated gradients by the step's
        # global target-token count; without it a no-op (the loss was normalized before backward).
        self._step_tokens.finish_gradients(
            self.model.parameters(), self._dp_group(), self.trainer.accumulate_grad_batches
        )

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log the step loss (``train/loss``, mean per target token of the global batch), then clip to
        ``grad_clip`` by the true global norm (DTensor-aware) and log that norm (before clipping)."""
        self._finish_step_gradients()  # already done by optimizer_step unless a subclass replaced it
        global_loss, _ = self._step_tokens.step_loss()
        # Not prog_bar: Lightning converts prog_bar metrics to numbers after every batch (a host sync);
        # kempnerforge.callbacks.ProgressBar shows train/loss at the logging interval instead.
        self.log("train/loss", global_loss, rank_zero_only=True)
        groups = getattr(self.trainer.strategy, "replica_groups", None)
        if groups is not None:  # fault tolerance: the groups whose gradients this step summed (known on the host)
            self.log(
                "train/replica_groups",
                torch.tensor(float(groups.participants), dtype=torch.float64),
                rank_zero_only=True,
            )
        pp_group = getattr(self.trainer.strategy, "pp_group", None)  # pipeline stages: norm over all of them
        # A tied embedding's copy on the last pipeline stage: clipped, but counted once (on the first stage).
        skip = getattr(self.trainer.strategy, "grad_norm_skip", ())
        norm = clip_grad_norm_(self.model.parameters(), self.grad_clip, pp_group=pp_group, norm_skip=skip)
        self.log("train/grad_norm", norm, rank_zero_only=True)
        self._moe_step()

    @override
    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Lightning's scheduler step, skipped after an optimizer step that fault tolerance did not commit
        (:mod:`kempnerforge.strategies.replica_steps`): the schedule follows the committed steps."""
        groups = getattr(self.trainer.strategy, "replica_groups", None) if _has_trainer(self) else None
        if groups is not None and not groups.committed:
            return
        super().lr_scheduler_step(scheduler, metric)

    def _moe_step(self) -> None:
        """MoE only: the once-per-optimizer-step router bias update (DeepSeek-V3 aux-loss-free
        balancing) and, at the trainer's log interval, the per-layer expert-load metrics."""
        self._moe.finish_step(self.model, self._dp_group(), self.config.bias_update_rate)
        every = max(1, self.trainer.log_every_n_steps)
        if self.config.num_experts > 0 and (self.trainer.global_step + 1) % every == 0:
            metrics = self._moe.metrics(self.model)
            if not metrics:  # a pipeline stage of dense blocks only
                return
            # One read-back for all layers' statistics (the logger would read each value on its own).
            values = torch.stack([v.detach().float().reshape(()) for v in metrics.values()]).cpu()
            for name, value in zip(metrics, values, strict=True):
                self.log(name, value, rank_zero_only=True)

    @override
    def on_validation_epoch_start(self) -> None:
        """Schedule-Free: evaluate the averaged weights ``x`` (no-op for other optimizers)."""
        if _has_trainer(self) and self.trainer.optimizers:
            set_schedule_free_mode(self.trainer.optimizers[0], train=False)

    @override
    def on_validation_epoch_end(self) -> None:
        """Schedule-Free: back to the training point ``y`` before checkpoints and the next step."""
        if _has_trainer(self) and self.trainer.optimizers:
            set_schedule_free_mode(self.trainer.optimizers[0], train=True)

    # -- checkpoint extras ----------------------------------------------------------------------

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the token counter in the checkpoint so ``tokens_seen`` continues after resume."""
        checkpoint["tokens_seen"] = self.tokens_seen

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore ``tokens_seen``; apply a ``model.optimizer`` lr / betas / weight decay / eps that differs from the
        checkpoint's over the restored optimizer and schedule, one line each
        (:func:`~kempnerforge.training.resume_overrides.apply_optimizer_overrides`)."""
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        if not _has_trainer(self) or not self.trainer.optimizers:
            return
        saved = (checkpoint.get("hyper_parameters") or {}).get("optimizer")
        lines = apply_optimizer_overrides(
            saved, asdict(self.optimizer_config), self.trainer.optimizers, checkpoint.get("lr_schedulers")
        )
        for line in lines:
            rank_zero_info(line)


class VisionLanguage(CausalLM):
    """Image-conditioned next-token training of a VLM (``encoder -> connector -> backbone``).

    Everything about the loss, its normalization per optimizer step, clipping, logging and
    checkpoint extras is :class:`CausalLM`'s; this class builds a
    :class:`~kempnerforge.model.vlm.model.VisionLanguageModel`, feeds it pixels and masks, applies
    the freeze spec and holds every ever-trainable parameter in the optimizer.

    Batches (:class:`~kempnerforge.data.image_text.ImageTextCollator` or the video collator):
    ``input_ids``, ``labels`` (batch, text) int64 (-100 at padding), ``text_mask`` (batch, text)
    bool, ``pixel_values`` (batch, 3, H, W) fp32 images or (batch, frames, 3, H, W) clips with
    ``frame_mask`` (batch, frames) bool, and optionally ``skipped_clips`` (0-dim int64: unreadable
    clips the data skipped for this batch), summed over data-parallel ranks and logged as
    ``data/skipped_clips`` (cumulative) at the trainer's log interval.

    Args:
        config: the text backbone (``--model.config.*``); ``max_seq_len`` must cover the positions the
            arch's self-attention sees (``sequence_length(n_visual, text)``, checked in :meth:`setup`).
        vlm: the architecture (``--model.vlm.arch`` etc.).
        encoder: the vision tower.
        connector: the connector.
        freeze: what trains at the start (a ``FreezeSchedule`` callback may change it by step).
        optimizer, scheduler, grad_clip, init_seed, z_loss_weight, loss_chunk_size, loss_impl: as :class:`CausalLM`
            (``auto``: the head fused with the loss over token chunks with tp=1 and pp=1, on the text positions).
        init_from: the language model's Hugging Face ``save_pretrained`` folder (Llama, Qwen 2 / 3, Mixtral, Qwen-MoE,
            DeepSeek-V3; MoE folders with joint_decoder / cross_attention, MLA not with mot, see
            :func:`check_vlm_text_config`): its ``config.json`` is the text model (``--model.config.*`` as
            :class:`CausalLM`'s ``init_from``) and each rank reads its shard of the text weights after sharding;
            what the text model lacks keeps its init (cross_attention: zero-gated cross blocks, so the model is the
            text model at step 0; MoT: the text weights in every modality's tower; MoMa: every expert a copy of the
            FFN, its routers random). The data's tokenizer defaults to the same folder. None: random init.
        float8_vision: with the strategy's ``float8_recipe``, convert the vision encoder's and connector's Linears
            too; by default only the backbone's are FP8 (the tower, usually frozen, stays in the compute dtype).

    Raises:
        ValueError: the data's text length beyond what ``max_seq_len`` allows for the arch (in :meth:`setup`).
        UserError: see :class:`CausalLM` (``init_from``) and :func:`check_vlm_text_config`.
        MeshConfigError: parallel settings the VLM does not support (in :meth:`validate_parallel`).
    """

    supports_context_parallel = (
        "the vision-language backbones take no context-parallel positions or masks yet (their visual tokens and "
        "cross-attention keys would need their own split)"
    )

    def __init__(
        self,
        config: ModelConfig = ModelConfig(),  # noqa: B008
        vlm: VLMConfig = VLMConfig(),  # noqa: B008
        encoder: VisionEncoderConfig = VisionEncoderConfig(),  # noqa: B008
        connector: ConnectorConfig = ConnectorConfig(),  # noqa: B008
        freeze: FreezeSpec = FreezeSpec(),  # noqa: B008
        optimizer: OptimizerConfig = OptimizerConfig(),  # noqa: B008
        scheduler: SchedulerConfig = SchedulerConfig(),  # noqa: B008
        grad_clip: float = 1.0,
        init_seed: int = 0,
        loss_chunk_size: int = 0,
        z_loss_weight: float = 0.0,
        loss_impl: str = "auto",
        init_from: str | None = None,
        float8_vision: bool = False,
    ) -> None:
        super().__init__(
            config,
            optimizer,
            scheduler,
            grad_clip,
            init_seed,
            loss_chunk_size,
            z_loss_weight,
            init_from=init_from,
            loss_impl=loss_impl,
        )
        check_vlm_text_config(self.config, vlm, init_from)
        self.vlm_config, self.encoder_config, self.connector_config, self.freeze = vlm, encoder, connector, freeze
        self.float8_vision = float8_vision
        self._skipped_clips: torch.Tensor | None = None  # this rank's count since the run started
        self._visual_positions: int | None = None  # visual tokens per sample in the last batch
        self._skipped_clips_shown = 0
        self.save_hyperparameters(
            {
                **self.hparams,
                "vlm": asdict(vlm),
                "encoder": asdict(encoder),
                "connector": asdict(connector),
                "freeze": asdict(freeze),
                "float8_vision": float8_vision,
            }
        )

    def validate_parallel(self, dims: ParallelDims) -> None:
        """:meth:`CausalLM.validate_parallel` plus the VLM's rules.

        Raises:
            MeshConfigError: ``moma`` with ``num_experts > 0`` (MoMa's experts are its own modality
                groups) or ``ep > 1``; ``tp`` not dividing ``cross_attn_n_kv_heads``; sequence parallelism with an
                arch other than joint_decoder.
        """
        cfg, vlm = self.config, self.vlm_config
        if vlm.arch == "moma" and (cfg.num_experts > 0 or dims.ep > 1):
            raise MeshConfigError(
                f"vlm.arch='moma' needs model.config.num_experts=0 and ep=1 (got num_experts={cfg.num_experts}, "
                f"ep={dims.ep}): MoMa's experts are its per-modality groups (vlm.moma_experts_per_modality), "
                "not the decoder's MoE layers, and they are not expert-parallel."
            )
        super().validate_parallel(dims)
        kv = vlm.cross_attn_n_kv_heads
        if vlm.arch == "cross_attention" and kv is not None and kv % dims.tp:
            raise MeshConfigError(f"tp={dims.tp} must divide vlm.cross_attn_n_kv_heads={kv}.")
        strategy = self.trainer.strategy if _has_trainer(self) else None
        sequence_parallel = getattr(strategy, "sequence_parallel", False)
        if sequence_parallel and vlm.arch != "joint_decoder":
            raise MeshConfigError(
                f"sequence_parallel=True is not supported for vlm.arch={vlm.arch!r} (allowed: joint_decoder): its "
                "per-modality dispatch or cross-attention reads the whole sequence; set it to False."
            )
        self._sequence_parallel_degree = dims.tp if sequence_parallel else 1

    def n_visual(self) -> int:
        """Visual tokens per image (from the configs alone; reads the encoder's config.json if pretrained)."""
        grid, width = encoder_grid_and_width(self.encoder_config)
        return connector_tokens(self.connector_config, grid, width)

    def check_data(self, datamodule: Any) -> None:
        """Check that the data's visual and text lengths fit ``max_seq_len`` for the arch, before the model
        is built (a video datamodule's ``max_frames`` multiplies the visual tokens per frame).

        Raises:
            ValueError: ``sequence_length(max_frames * n_visual, max_text_len) > max_seq_len`` (names the numbers).
        """
        max_text = getattr(datamodule, "max_text_len", None)
        if max_text is not None:
            frames = getattr(datamodule, "max_frames", None) or 1
            check_vlm_lengths(self.config, self.vlm_config, self.n_visual(), max_text, frames)

    def image_processor(self):
        """The image processor matching the encoder (see :func:`~kempnerforge.model.vision.build_image_processor`)."""
        return build_image_processor(self.encoder_config)

    @override
    def configure_model(self) -> None:
        """Build the VLM once (on meta under KempnerStrategy) and apply the freeze spec."""
        if self.model is not None:
            return
        self.model = VisionLanguageModel(
            self.config,
            self.vlm_config,
            self.encoder_config,
            self.connector_config,
            init_from=self.init_from,
            float8_vision=self.float8_vision,
        )
        # joint_decoder: the joint sequence is padded to a multiple of tp for sequence parallelism (validate_parallel)
        self.model.backbone.sequence_parallel_degree = getattr(self, "_sequence_parallel_degree", 1)
        if not any(p.is_meta for p in self.model.parameters()):
            with torch.no_grad():
                self.model.init_weights(seed=self.init_seed)
        apply_freeze(self.model, self.freeze)

    def _media_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[tuple, dict]:
        """The model's positional and keyword inputs for ``batch`` (ids, pixels, masks, the host count of real
        frames); records the visual positions for :meth:`flops_per_token` (shapes only: no sync)."""
        pixels = batch.get("pixel_values")
        if pixels is not None:
            self._visual_positions = (pixels.shape[1] if pixels.dim() == 5 else 1) * self.model.n_visual
        masks = tuple(batch.get(k) for k in ("text_mask", "visual_mask", "frame_mask"))
        # real_frames: the collator's host count of real frames (no read-back of frame_mask).
        return (batch["input_ids"], pixels, *masks), {"real_frames": batch.get("real_frames")}

    def _logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        args, kwargs = self._media_inputs(batch)
        return self.model(*args, **kwargs)

    @override
    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], slice | None]:
        """Under ``pp > 1`` (joint_decoder): ``(input_ids, pixel_values)`` for the first stage and the text positions
        ``slice(n_visual, n_visual + n_text)`` of the joint sequence for the last stage's head (shapes only: no sync).

        Raises:
            ValueError: a batch without pixels, or with padded visual tokens (a ``visual_mask``, or a ``frame_mask``
                whose host count of real frames is not every frame): the stages pass no per-sequence mask.
        """
        (ids, pixels, _, visual_mask, frame_mask), kwargs = self._media_inputs(batch)
        real = kwargs["real_frames"]
        if pixels is None or visual_mask is not None or (frame_mask is not None and real != frame_mask.numel()):
            raise ValueError(
                "pp > 1 takes batches whose every visual token is real (images, or clips with no padded frame): "
                "the pipeline's stage boundary carries the hidden states only, no per-sequence mask."
            )
        return (ids, pixels), slice(self._visual_positions, self._visual_positions + ids.shape[1])

    def _fused_loss(
        self, batch: dict[str, torch.Tensor], z_loss_weight: float, loss_impl: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`CausalLM._fused_loss` with the batch's pixels and masks."""
        args, kwargs = self._media_inputs(batch)
        return self.model(
            *args,
            **kwargs,
            labels=batch["labels"],
            loss_chunk_size=self.loss_chunk_size,
            z_loss_weight=z_loss_weight,
            loss_impl=loss_impl,
        )

    @override
    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, **masks: Any) -> torch.Tensor:
        """Logits (batch, text, vocab_size) as a plain tensor (see :class:`VisionLanguageModel`); ``masks``:
        ``text_mask``, ``visual_mask``, ``frame_mask``."""
        return to_full(self._logits({"input_ids": input_ids, "pixel_values": pixel_values, **masks}))

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """:meth:`CausalLM.training_step`, plus the count of clips the data skipped (``data/skipped_clips``)."""
        if "skipped_clips" in batch:
            self._log_skipped_clips(batch["skipped_clips"])
        return super().training_step(batch, batch_idx)

    def _log_skipped_clips(self, skipped: torch.Tensor) -> None:
        # Kept on the device and summed over dp ranks only at the log interval: no per-step host sync.
        count = skipped.detach().to(torch.long).sum()
        self._skipped_clips = count if self._skipped_clips is None else self._skipped_clips + count
        if (self.trainer.global_step + 1) % max(1, self.trainer.log_every_n_steps):
            return
        total = self._skipped_clips.clone()
        group = self._dp_group()
        if group is not None:
            dist.all_reduce(total, group=group)
        self.log("data/skipped_clips", total.float(), rank_zero_only=True)
        count = int(total)  # one host sync per log interval
        if count > self._skipped_clips_shown:  # on the console too, not only in the logger
            self._skipped_clips_shown = count
            rank_zero_warn(
                f"data: {count} unreadable clip(s) skipped so far, each replaced by the next readable one "
                "(data/skipped_clips; the dataset warnings name the files)."
            )

    def flops_per_token(self, seq_len: int) -> int:
        """Backbone training FLOPs per text token, FLOP/token (what MFU counts for a VLM).

        Joint-sequence archs (joint decoder, MoT, MoMa) run every visual position through the decoder
        blocks too, so a sample costs ``S * (F(S) - head) + seq_len * head`` with ``S`` the positions
        the arch's self-attention sees (:meth:`VLMBackbone.sequence_length` of the last batch's visual
        tokens, frames x per-frame tokens for clips), ``F`` the dense decoder's
        :meth:`ModelConfig.flops_per_token` and ``head = 6 * vocab_size * dim`` (logits are for text
        positions only); divided by ``seq_len`` text tokens. Not counted: the vision encoder (frozen
        by default) and connector, and cross-attention blocks (their visual keys and values).

        Raises:
            ValueError: ``seq_len`` not a positive integer.
        """
        per_position = self.config.flops_per_token(seq_len)
        n_visual = self._visual_positions if self._visual_positions is not None else self.n_visual()
        if self.model is not None:
            positions = self.model.backbone.sequence_length(n_visual, seq_len)
        else:
            with torch.device("meta"):
                positions = build_backbone(self.config, self.vlm_config).sequence_length(n_visual, seq_len)
        if positions == seq_len:
            return per_position
        head = 6 * self.config.vocab_size * self.config.dim
        body = self.config.flops_per_token(positions) - head
        return (positions * body + seq_len * head) // seq_len

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over every parameter trainable under the initial spec or any ``FreezeSchedule`` step, with
        its state created up front (:func:`~kempnerforge.training.freeze.init_adamw_state`), and the schedule."""
        specs = [self.freeze]
        for cb in self.trainer.callbacks if _has_trainer(self) else []:
            specs += cb.specs if isinstance(cb, FreezeSchedule) else []
        keep = {id(p) for p in ever_trainable(self.model, specs)}
        flags = {p: p.requires_grad for p in self.model.parameters()}
        for p in flags:  # param_groups() takes trainable parameters: make it see the ever-trainable set
            p.requires_grad_(id(p) in keep)
        try:
            out = super().configure_optimizers()
        finally:
            for p, flag in flags.items():
                p.requires_grad_(flag)
        optimizer = out["optimizer"]
        if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            init_adamw_state(optimizer)
        elif len(specs) > 1:
            raise ValueError(
                f"a FreezeSchedule needs an Adam/AdamW optimizer (its state is created up front so a resume "
                f"matches whatever is frozen); got {type(optimizer).__name__}. Drop the schedule or use AdamW."
            )
        return out


def check_vlm_text_config(text: ModelConfig, vlm: VLMConfig, init_from: str | None) -> None:
    """The text model (``model.config``, or the folder's ``config.json`` under ``init_from``) is one the arch's
    backbone builds: ``mot`` unties GQA projections per modality, so it takes no multi-head latent attention; ``mot``
    and ``moma`` have per-modality FFNs, so no token-choice MoE layers (joint_decoder and cross_attention build the
    text model's own blocks: MLA and MoE as for text; MoMa's shared attention may be MLA); and under ``init_from``
    with ``moma`` an FFN whose width every expert can copy (sparse upcycling).

    Raises:
        UserError: (a ``ValueError``) ``mot`` with ``attention='mla'`` (field ``model.config.attention``, or
            ``model.init_from`` naming the folder's); ``mot`` / ``moma`` with ``num_experts > 0``; ``moma`` experts of
            another width than the folder's FFN.
    """
    if vlm.arch == "mot" and text.attention != "gqa":
        _refuse_text_field(
            init_from,
            "attention",
            repr(text.attention),
            "vlm.arch='mot', which unties the attention's q/k/v/o projections per modality (MLA's shared latent "
            "projections have no per-modality form here); allowed: 'gqa' (joint_decoder, cross_attention and moma "
            "take MLA)",
        )
    if vlm.arch in ("mot", "moma") and text.num_experts > 0:
        ffn = "unties a dense FFN per modality" if vlm.arch == "mot" else "has its own per-modality expert groups"
        _refuse_text_field(
            init_from,
            "num_experts",
            str(text.num_experts),
            f"vlm.arch={vlm.arch!r}, which {ffn} (no token-choice MoE layers); allowed: 0 (joint_decoder and "
            "cross_attention take MoE)",
        )
    if init_from is not None and vlm.arch == "moma" and text.expert_hidden != text.ffn_hidden:
        raise UserError(
            "model.config.expert_width_multiplier",
            f"vlm.arch='moma' with model.init_from copies the folder's FFN (width {text.ffn_hidden}) into every "
            f"expert, whose width is {text.expert_hidden}; allowed: 1 (experts as wide as the FFN)",
        )


def _refuse_text_field(init_from: str | None, name: str, value: str, why: str) -> None:
    """Raise the UserError for text field ``name`` (``ModelConfig.<name>`` = ``value``) the arch does not take: under
    ``model.config.<name>``, or ``model.init_from`` naming the folder whose ``config.json`` set it. The message starts
    with the field as the CLI reads it from a wrapped error (:func:`~kempnerforge.cli_errors.infer_field`)."""
    if init_from is None:
        raise UserError(f"model.config.{name}", f"ModelConfig.{name}={value} is not taken by {why}")
    raise UserError("model.init_from", f"init_from={init_from} has ModelConfig.{name}={value}, not taken by {why}")


def encoder_grid_and_width(cfg: VisionEncoderConfig) -> tuple[tuple[int, int], int]:
    """(patch grid (rows, cols), feature width) of the tower ``cfg`` describes, without building it."""
    hf = hf_vision_config(cfg)
    side = hf.image_size // hf.patch_size
    return (side, side), hf.hidden_size


def check_vlm_lengths(text: ModelConfig, vlm: VLMConfig, n_visual: int, max_text_len: int, max_frames: int = 1) -> int:
    """Positions the arch's self-attention sees for ``max_frames x n_visual`` visual and ``max_text_len``
    text tokens (``n_visual`` per image or frame; ``max_frames`` 1 for images).

    Raises:
        UserError: (a ``ValueError``) more than ``text.max_seq_len`` (the RoPE tables end there); names the numbers.
    """
    with torch.device("meta"):
        backbone = build_backbone(text, vlm)
    seq = backbone.sequence_length(max_frames * n_visual, max_text_len)
    if seq > text.max_seq_len:
        visual = f"{n_visual} visual" if max_frames == 1 else f"data.max_frames={max_frames} x {n_visual} visual"
        raise UserError(
            "model.config.max_seq_len",
            f"vlm.arch={vlm.arch!r} sees {seq} positions ({visual} + {max_text_len} text tokens per "
            f"sample, data.max_text_len) but model.config.max_seq_len={text.max_seq_len}: raise max_seq_len to "
            f">= {seq} or lower data.max_text_len / the connector's token count"
            + (" / data.max_frames." if max_frames > 1 else "."),
        )
    return seq
