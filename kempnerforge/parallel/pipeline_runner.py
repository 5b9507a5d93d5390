"""This rank's pipeline: pruning, stage modules, materialization, the schedule, one training step.

Used by :class:`kempnerforge.strategies.KempnerStrategy` when ``pp > 1``; the pure pieces (split,
validation, schedule table) are in :mod:`kempnerforge.parallel.pipeline`. Composition follows
torchtitan v0.2 ``pipeline_llama``: prune the meta model to this rank's stages, run the TP -> FP8 ->
AC -> compile chain on it, then FSDP2 per stage (``reshard_after_forward=False``: every stage's
parameters are reused by every micro-batch), materialize, build ``PipelineStage`` s and the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from kempnerforge.model.transformer import Transformer
from kempnerforge.parallel.context_parallel import ContextShard
from kempnerforge.parallel.mesh import MeshConfigError
from kempnerforge.parallel.pipeline import (
    build_schedule,
    prune_to_stages,
    resolve_microbatches,
    stage_ids,
    stage_layer_ranges,
)
from kempnerforge.parallel.pipeline_aux import StageAuxLosses
from kempnerforge.parallel.pipeline_stage import DecoderStage, JointDecoderStage
from kempnerforge.parallel.pipeline_tied import reduce_tied_grads
from kempnerforge.training.loss import IGNORE_INDEX, token_cross_entropy_sum


class PipelineRunner:
    """Owns this rank's stages and schedule.

    Args:
        pp_mesh: 1-D ``pp`` mesh (``ParallelMesh.world["pp"]``).
        n_layers: blocks of the full model.
        schedule: a name from :data:`kempnerforge.parallel.pipeline.SCHEDULES`.
        microbatches: micro-batches per step (None: one per stage).
        virtual_stages: stages per rank.
        split_points: explicit stage boundaries, or None (balanced by layer count).

    Call order: :meth:`prune` (meta model) -> the transform chain on the pruned model ->
    :meth:`make_stages` (the FSDP2 units) -> :meth:`materialize` -> :meth:`build` -> :meth:`train_step`.
    """

    def __init__(
        self,
        pp_mesh: DeviceMesh,
        n_layers: int,
        schedule: str,
        microbatches: int | None,
        virtual_stages: int,
        split_points: Sequence[int] | None,
    ) -> None:
        self.pp_mesh = pp_mesh
        self.pp = pp_mesh.size()
        self.schedule_name = schedule
        self.microbatches = resolve_microbatches(microbatches, self.pp, virtual_stages)
        self.ranges = stage_layer_ranges(n_layers, self.pp * virtual_stages, split_points)
        self.ids = stage_ids(pp_mesh.get_local_rank(), self.pp, virtual_stages, schedule)
        self.n_stages = len(self.ranges)
        self.stage_modules: list[DecoderStage] = []
        self.schedule = None
        self._sums: list[torch.Tensor] = []
        self._scale: torch.Tensor | float = 1.0
        self._grads: list[torch.Tensor | None] = []
        self._aux: StageAuxLosses | None = None  # MoE models: set at the first training step
        self._shape_inference = True  # the schedule infers shapes at its first step and after each eval pass
        #: With tied embeddings: the first/last-stage group (None on middle pp ranks, or untied).
        self.tied_group: dist.ProcessGroup | None = None
        self._tied_pending = False

    @property
    def has_first(self) -> bool:
        """This rank holds stage 0 (feeds the token ids)."""
        return 0 in self.ids

    @property
    def has_last(self) -> bool:
        """This rank holds the last stage (computes the loss)."""
        return self.n_stages - 1 in self.ids

    def tied_weight(self, model: nn.Module) -> torch.Tensor | None:
        """This rank's copy of a tied embedding weight (first or last stage), else None."""
        decoder = decoder_of(model)
        if self.tied_group is None or decoder.tok_embeddings is None:
            return None
        return decoder.tok_embeddings.weight

    def norm_skip(self, model: nn.Module) -> list[torch.Tensor]:
        """Parameters the gradient norm must not count on this rank: the last stage's copy of a tied
        embedding (the first stage counts the one logical weight)."""
        weight = self.tied_weight(model)
        return [weight] if weight is not None and not self.has_first else []

    def finish_step_gradients(self, model: nn.Module) -> None:
        """Once per optimizer step, after the last backward: sum the tied embedding's gradients of the first
        and last stage (:func:`~kempnerforge.parallel.pipeline_tied.reduce_tied_grads`); a no-op otherwise."""
        weight = self.tied_weight(model)
        if weight is not None and self._tied_pending:
            reduce_tied_grads(weight, self.tied_group)
        self._tied_pending = False

    def prune(self, model: nn.Module) -> None:
        """Drop every module of ``model`` (meta) that this rank's stages do not hold: a joint_decoder VLM's
        encoder and connector go with stage 0, its backbone is pruned as the decoder.

        Raises:
            MeshConfigError: ``model`` is neither the decoder (:class:`~kempnerforge.model.Transformer`, dense or
                MoE) nor a VLM whose backbone is a :class:`~kempnerforge.model.vlm.joint_decoder.JointDecoder`.
        """
        if type(model) is not Transformer and not _is_joint_decoder_vlm(model):
            raise MeshConfigError(
                f"pp={self.pp} supports the decoder (kempnerforge.model.Transformer) and joint_decoder "
                f"vision-language models only, not {type(model).__name__}; use pp=1."
            )
        prune_to_stages(decoder_of(model), self.ranges, self.ids)
        if decoder_of(model) is not model and not self.has_first:
            model.encoder = None
            model.connector = None

    def make_stages(self, model: nn.Module, sp_degree: int = 1) -> list[DecoderStage]:
        """One :class:`DecoderStage` (:class:`JointDecoderStage` for a VLM) per local stage over the (transformed)
        pruned model: the FSDP2 units. ``sp_degree``: tp under sequence parallelism, else 1."""
        cls = JointDecoderStage if decoder_of(model) is not model else DecoderStage
        self.stage_modules = [cls(model, self.ranges[s], first=s == 0, last=s == self.n_stages - 1) for s in self.ids]
        for stage in self.stage_modules:
            stage.sp_degree = sp_degree
        for stage in self.stage_modules:
            for layer in stage.moe_layers().values():
                # Activation checkpointing: every micro-batch's forward (and the shape inference's) may run
                # before the first backward recomputes; the recomputations come in forward order.
                layer.saved_routing_depth = self.microbatches + 1
        return self.stage_modules

    def materialize(self, model: nn.Module, device: torch.device, seed: int) -> None:
        """Allocate the meta tensors on ``device`` and run ``model.init_weights(seed)``: each element is drawn from
        (seed, FQN, global index) on ``device``, for this rank's stages and shards only, so the weights equal the
        unsplit model's.

        FSDP2 stages are materialized through their own ``to_empty`` (FSDP2 re-registers its sharded
        parameters there); what remains on meta (RoPE buffers, unsharded stages) is allocated in place.
        """
        for stage in self.stage_modules:
            if isinstance(stage, FSDPModule):
                stage.to_empty(device=device)
        for module in model.modules():
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, t in own:
                if t.is_meta:
                    new = torch.empty_like(t, device=device)
                    # setattr on a registered name replaces it in place (a buffer keeps its persistence).
                    setattr(module, name, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new)
        decoder = decoder_of(model)
        if decoder.tok_embeddings is not None and decoder.output is not None:
            decoder.tie_weights()  # materialization unties a shared parameter (a no-op when untied)
        with torch.no_grad():
            model.init_weights(seed=seed)

    def build(self, device: torch.device) -> None:
        """Create the ``PipelineStage`` s (shapes inferred at the first step) and the schedule."""
        group = self.pp_mesh.get_group()
        stages = [
            PipelineStage(mod, s, self.n_stages, device, group=group)
            for mod, s in zip(self.stage_modules, self.ids, strict=True)
        ]
        self.schedule = build_schedule(self.schedule_name, stages, self.microbatches, self._loss_fn)

    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, _ = token_cross_entropy_sum(logits, labels)
        self._sums.append(loss_sum.detach())
        return loss_sum * self._scale

    def _reduced_sum(self, device: torch.device, extra: torch.Tensor | None = None) -> torch.Tensor:
        """This step's summed token loss from the last stage, the same on every pp rank (fp32 scalar); with
        ``extra`` (a per-rank fp32 scalar, e.g. the stages' aux losses) the pair ``(loss, sum of extra)``,
        reduced in the same all-reduce."""
        # The first step's shape inference calls the loss once more on its own: keep the micro-batches' losses.
        sums = self._sums[-self.microbatches :]
        total = torch.stack(sums).sum() if sums else torch.zeros((), device=device)
        self._sums = []
        both = total if extra is None else torch.stack([total, extra.float()])
        dist.all_reduce(both, group=self.pp_mesh.get_group())  # other ranks add exact zeros
        return both if extra is None else (both[0], both[1])

    def train_step(
        self,
        inputs: tuple[torch.Tensor, ...],
        labels: torch.Tensor,
        loss_scale: torch.Tensor | float,
        with_aux: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of every micro-batch through the schedule.

        Args:
            inputs: the first stage's inputs (:meth:`prepare`), each split along dim 0 into the micro-batches:
                ``(input_ids,)`` ``(batch, seq)`` int64 for the decoder, ``(input_ids, pixel_values)`` for a VLM;
                identical on every pp rank of a data shard.
            labels: ``(batch, seq)`` int64 (``-100`` ignored).
            loss_scale: factor on each micro-batch's summed token loss before its backward: ``dp_size /
                N_global`` (a device scalar) without gradient accumulation, else ``dp_size /
                accumulate_grad_batches`` (the gradients are normalized after the step's last batch by
                :class:`kempnerforge.training.loss.StepTokenNormalizer`).

            with_aux: also return the MoE aux losses of every stage and micro-batch (summed; 0 for a
                dense model).

        Returns:
            The summed (un-normalized) token loss of the whole batch (fp32 scalar, detached), the same
            on every pp rank; with ``with_aux`` the pair ``(loss_sum, aux_sum)``.
        """
        self._scale = loss_scale
        self._run(self.schedule.step, inputs, labels)
        self._shape_inference = False
        aux = torch.zeros((), device=labels.device)
        if self._aux is not None and self._aux.active:
            aux = self._aux.finish(len(self.stage_modules)).to(aux.device)
        loss_sum, aux = self._reduced_sum(labels.device, aux)
        return (loss_sum, aux) if with_aux else loss_sum

    def training_step(self, module: Any, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """``CausalLM.training_step`` for a pipeline: the schedule's forward + backward, then the module's
        step accounting (token normalization, logging) with the last stage's loss.

        Lightning zeroes gradients between ``training_step`` and ``backward`` (first micro-batch of an
        accumulation window), so the gradients are zeroed here instead at that point and set aside
        until :meth:`restore_grads` (called from the strategy's ``backward``).

        Returns:
            The module's detached step loss (the backward already ran).
        """
        accumulate = module.trainer.accumulate_grad_batches
        params = list(module.model.parameters())
        if batch_idx % accumulate == 0:  # a new optimizer step
            for p in params:
                p.grad = None
        full, (batch, inputs, labels) = batch, self.prepare(module, batch)
        n_targets = (labels != IGNORE_INDEX).sum()
        scale = _loss_scale(module, n_targets, accumulate)
        if module.config.num_experts > 0:
            self._start_moe(module, labels, scale, new_step=batch_idx % accumulate == 0)
        loss_sum, aux = self.train_step(inputs, labels, scale, with_aux=True)
        self._tied_pending = self.tied_group is not None
        self._grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        if self._aux is not None:
            module.log("train/moe_aux_loss", aux / self.microbatches, rank_zero_only=True)
        # The stages' MoE aux losses already ran in the schedule's backward (pipeline_aux).
        return module._record_step(full, batch_idx, loss_sum, n_targets, moe_aux_in_backward=True)

    def prepare(
        self, module: Any, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], tuple[torch.Tensor, ...], torch.Tensor]:
        """``(batch, inputs, labels)`` for one schedule run: the batch as this rank sees it (its context-parallel
        share of each sequence), the first stage's inputs and the labels (``module.pipeline_inputs``); gives every
        local stage the cp share and, for a VLM, the text positions of the joint sequence."""
        batch = module._cp_batch(batch)
        self.set_cp(batch.get("cp"))
        inputs, text = module.pipeline_inputs(batch)
        for stage in self.stage_modules:
            if isinstance(stage, JointDecoderStage):
                stage.text = text
        return batch, inputs, batch["labels"]

    def set_cp(self, shard: ContextShard | None) -> None:
        """Give every local stage this rank's context-parallel share (None: cp = 1) for the next schedule run."""
        for stage in self.stage_modules:
            stage.cp = shard

    def _start_moe(self, module: Any, labels: torch.Tensor, scale: torch.Tensor | float, new_step: bool) -> None:
        """Hook the stages' MoE bookkeeping for one step: micro-batch ``m``'s aux loss gets the gradient
        ``n_targets(m) * scale``, as ``CausalLM._add_moe_aux_loss`` gives it without pipelining."""
        if self._aux is None:
            self._aux = StageAuxLosses(module._moe)
            for stage in self.stage_modules:
                stage.after_blocks = self._aux.after_blocks
        # The schedule splits the batch into equal micro-batches along dim 0 (validate_microbatches).
        per_micro = (labels != IGNORE_INDEX).reshape(self.microbatches, -1).sum(1).float()
        self._aux.start(per_micro * scale, new_step, self._shape_inference)

    def restore_grads(self, model: nn.Module) -> None:
        """Give ``model``'s parameters back the gradients :meth:`training_step` set aside."""
        for p, grad in zip(model.parameters(), self._grads, strict=True):
            p.grad = grad
        self._grads = []

    def eval_step(self, module: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only of ``batch`` (:meth:`prepare`); returns ``(loss_sum, n_targets)`` of this rank's share (fp32 /
        int64 scalars, every pp rank)."""
        _, inputs, labels = self.prepare(module, batch)
        with torch.no_grad():
            self._run(self.schedule.eval, inputs, labels)
        self._shape_inference = True  # the next training step re-runs the schedule's metadata inference
        return self._reduced_sum(labels.device), (labels != IGNORE_INDEX).sum()

    def _run(self, fn, inputs: tuple[torch.Tensor, ...], labels: torch.Tensor) -> None:
        self._sums = []
        target = labels if self.has_last else None
        args = inputs if self.has_first else ()
        kwargs = {"return_outputs": False} if fn == self.schedule.step else {}
        fn(*args, target=target, **kwargs)


def _loss_scale(module: Any, n_targets: torch.Tensor, accumulate: int) -> torch.Tensor | float:
    """What the module's normalization applies to a micro-batch's summed loss before its backward (see
    ``CausalLM._record_step``): ``dp / N_global`` without accumulation (the labels are on every pp rank,
    so the count is all-reduced over dp before the schedule runs; no host read-back), else ``dp /
    accumulate`` (Lightning's division of the returned loss; the gradients are normalized at the end)."""
    dp = module._dp_size()
    if accumulate != 1:
        return dp / accumulate
    n = n_targets.detach().double().reshape(1)
    group = module._dp_group()
    if group is not None:
        dist.all_reduce(n, group=group)
    return (dp / n[0].clamp(min=1)).float()


def update_validation_metrics(module: object, loss_sum: torch.Tensor, n_targets: torch.Tensor) -> None:
    """Feed a pipelined validation batch into ``CausalLM``'s ``val/loss`` and ``val/ppl``.

    The pipeline's ``loss_sum`` (summed token loss of the batch, on every pp rank) and ``n_targets`` are
    what :meth:`CausalLM.record_validation` takes, so the result equals an unsplit model's
    ``validation_step`` (which needs the logits, here only on the last stage).
    """
    module.record_validation(loss_sum, n_targets)


def decoder_of(model: nn.Module) -> nn.Module:
    """The module holding ``tok_embeddings``, ``layers``, ``norm``, ``output`` and the RoPE buffers: the decoder
    itself, or a vision-language model's ``backbone``."""
    backbone = getattr(model, "backbone", None)
    return backbone if isinstance(backbone, nn.Module) else model


def _is_joint_decoder_vlm(model: nn.Module) -> bool:
    from kempnerforge.model.vlm.joint_decoder import JointDecoder

    return isinstance(getattr(model, "backbone", None), JointDecoder)
