"""Pipeline parallelism for the decoder (dense or MoE, tied or not): option checks, stage split, per-rank
pruning, schedules.

Follows torchtitan v0.2 (``distributed/pipeline_parallel.py`` and the Llama ``pipeline_llama``):
the ``n_layers`` blocks are cut into ``pp * virtual_stages`` stages (balanced by layer count or at
explicit split points), the token embedding lives on the first stage and the final norm + output
head on the last. Each rank keeps only the modules of its own stages, with the full model's FQNs,
so DCP checkpoints, the optimizer's parameter names and the HF export see the same keys at every
pp degree. Schedules come from ``torch.distributed.pipelining`` by name (GPipe, arXiv:1811.06965;
1F1B, PipeDream-Flush, arXiv:2006.09503; interleaved 1F1B, Megatron-LM arXiv:2104.04473; zero
bubble, arXiv:2401.10241).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
)

from kempnerforge.parallel.mesh import MeshConfigError

#: Schedule name -> torch.distributed.pipelining class.
SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
#: Schedules that run exactly one stage per rank.
SINGLE_STAGE: frozenset[str] = frozenset({"gpipe", "1f1b"})
#: Schedules whose two stages per rank are placed in a "V" (rank r holds stages r and 2*pp-1-r).
V_SHAPED: frozenset[str] = frozenset({"zbv"})


def validate_pipeline_options(
    pp: int, schedule: str, microbatches: int | None, virtual_stages: int, split_points: Sequence[int] | None
) -> None:
    """Check the pipeline options on their own (no model, no world size needed).

    Args:
        pp: pipeline-parallel degree.
        schedule: one of :data:`SCHEDULES`.
        microbatches: micro-batches per step and data-parallel rank, or None (one per stage).
        virtual_stages: stages per rank (1 for ``gpipe`` / ``1f1b``, exactly 2 for ``zbv``).
        split_points: first layer index of every stage after the first, or None (balanced).

    Raises:
        MeshConfigError: an unknown schedule, a virtual-stage count the schedule cannot run,
            ``microbatches`` < 1, malformed split points, or any pipeline option set with ``pp=1``.
    """
    if schedule not in SCHEDULES:
        raise MeshConfigError(f"pp_schedule={schedule!r} is not allowed; choose one of {sorted(SCHEDULES)}.")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise MeshConfigError(f"pp_virtual_stages={virtual_stages!r} must be an integer >= 1.")
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise MeshConfigError(f"pp_microbatches={microbatches!r} must be an integer >= 1 (or null: one per stage).")
    if pp == 1:
        if virtual_stages != 1 or microbatches is not None or split_points is not None:
            raise MeshConfigError(
                "pp_virtual_stages, pp_microbatches and pp_split_points only apply with pp > 1; "
                f"got pp=1 with pp_virtual_stages={virtual_stages}, pp_microbatches={microbatches}, "
                f"pp_split_points={split_points}."
            )
        return
    if schedule in SINGLE_STAGE and virtual_stages != 1:
        raise MeshConfigError(
            f"pp_schedule={schedule!r} runs one stage per rank: pp_virtual_stages must be 1, got {virtual_stages} "
            "(use interleaved_1f1b or zero_bubble for several)."
        )
    if schedule in V_SHAPED and virtual_stages != 2:
        raise MeshConfigError(f"pp_schedule={schedule!r} needs pp_virtual_stages=2, got {virtual_stages}.")
    if split_points is not None:
        points = list(split_points)
        n_stages = pp * virtual_stages
        if len(points) != n_stages - 1 or any(not isinstance(p, int) for p in points):
            raise MeshConfigError(
                f"pp_split_points={points} must list {n_stages - 1} layer indices (one per stage boundary of "
                f"pp*pp_virtual_stages = {pp}*{virtual_stages} = {n_stages} stages)."
            )
        if points != sorted(set(points)) or points[0] < 1:
            raise MeshConfigError(f"pp_split_points={points} must be strictly increasing layer indices >= 1.")


def validate_pipeline_model(
    pp: int,
    virtual_stages: int,
    split_points: Sequence[int] | None,
    *,
    n_layers: int,
    num_experts: int,
    tie_embeddings: bool,
    vlm_arch: str | None = None,
    ep: int = 1,
    schedule: str = "1f1b",
    tp: int = 1,
) -> None:
    """Check the pipeline against the model, before anything is allocated (no-op for ``pp=1``).

    MoE models pipeline (each stage's auxiliary losses enter the backward at that stage, its routers
    balance by their own load; :mod:`kempnerforge.parallel.pipeline_aux`), and so do tied embeddings
    (the last stage holds a copy of the embedding weight for its head, reduced with the first stage's;
    :mod:`kempnerforge.parallel.pipeline_tied`).

    Raises:
        MeshConfigError: more stages than layers, a split point at or past ``n_layers``, ``ep > 1``
            (expert parallelism inside stages is not proven on a pipeline yet), tied embeddings with a
            V-shaped schedule (``zbv`` puts the first and last stage on one rank as two FSDP2 roots,
            which cannot share one parameter), tied embeddings with ``tp > 1`` (the tensor-parallel copy of
            the tied weight on the last stage desynchronizes the stages' collectives: a gloo size mismatch),
            or a vision-language arch other than ``joint_decoder`` (``vlm_arch``; see :data:`VLM_REFUSAL`).
    """
    if pp == 1:
        return
    n_stages = pp * virtual_stages
    if n_stages > n_layers:
        raise MeshConfigError(
            f"pp*pp_virtual_stages = {pp}*{virtual_stages} = {n_stages} stages exceeds n_layers={n_layers}: "
            f"every stage needs at least one block; use at most {n_layers} stages."
        )
    if split_points is not None and max(split_points) >= n_layers:
        raise MeshConfigError(f"pp_split_points={list(split_points)} must be < n_layers={n_layers}.")
    if num_experts > 0 and ep > 1:
        raise MeshConfigError(
            f"ep={ep} with pp={pp} is not supported: expert parallelism inside pipeline stages has no parity "
            "proof yet (its all-to-alls would run inside the schedule's shape inference too); use ep=1 with pp > 1, "
            "or pp=1 with ep."
        )
    if tie_embeddings and schedule in V_SHAPED:
        raise MeshConfigError(
            f"pp_schedule={schedule!r} with tie_embeddings=true is not supported: the V placement puts the first "
            "and the last stage on one rank as two FSDP2 roots, which cannot share the tied weight; use "
            "1f1b, gpipe, interleaved_1f1b or zero_bubble, or set model.config.tie_embeddings=false."
        )
    if tie_embeddings and tp > 1:
        raise MeshConfigError(
            f"tp={tp} with pp={pp} and tie_embeddings=true is not supported: the last stage's tensor-parallel copy "
            "of the tied weight does not line up with the first stage's collectives yet; use tp=1 (dp_shard "
            "works) or set model.config.tie_embeddings=false."
        )
    if vlm_arch is not None and vlm_arch not in PIPELINED_VLM_ARCHS:
        raise MeshConfigError(f"pp={pp} with vlm.arch={vlm_arch!r}: {VLM_REFUSAL}")


#: Vision-language archs that pipeline (:class:`~kempnerforge.parallel.pipeline_stage.JointDecoderStage`).
PIPELINED_VLM_ARCHS: frozenset[str] = frozenset({"joint_decoder"})

#: Why the other vision-language archs do not pipeline (the message of :func:`validate_pipeline_model`).
VLM_REFUSAL = (
    "not supported with pp > 1 (allowed: joint_decoder); use pp=1 (with dp_shard / tp). mot / moma route "
    "every position by modality inside each block, which the pipeline's single-tensor stage boundary does not "
    "carry; cross_attention needs the image features at every stage's cross-attention layers."
)

#: Why video clips with padded frames do not pipeline (:func:`validate_pipeline_run`).
VIDEO_REFUSAL = (
    "video clips are padded to the longest in the batch, and their padded frames need a per-sequence mask "
    "at every stage, which the pipeline's single-tensor stage boundary does not carry; use pp=1 for video"
)


def is_vision_language(module: object) -> bool:
    """True when a LightningModule carries a :class:`~kempnerforge.config.vlm.VLMConfig` (a VLM) or its
    ``config`` is not the dense decoder's :class:`~kempnerforge.config.model.ModelConfig`."""
    from kempnerforge.config.model import ModelConfig
    from kempnerforge.config.vlm import VLMConfig

    if not isinstance(getattr(module, "config", None), ModelConfig):
        return True
    return any(isinstance(v, VLMConfig) for v in vars(module).values())


def _vlm_arch(module: object) -> str | None:
    """``vlm.arch`` of a vision-language LightningModule, ``"unknown"`` for another non-decoder model, else None."""
    if not is_vision_language(module):
        return None
    from kempnerforge.config.vlm import VLMConfig

    found = [v for v in vars(module).values() if isinstance(v, VLMConfig)]
    return found[0].arch if found else "unknown"


def validate_pipeline_run(
    pp: int,
    module: object,
    datamodule: object,
    *,
    schedule: str,
    microbatches: int | None,
    virtual_stages: int,
    split_points: Sequence[int] | None,
    ep: int = 1,
    tp: int = 1,
) -> None:
    """The pp rules that need the LightningModule and the datamodule (no-op for ``pp=1``).

    Checks :func:`validate_pipeline_model` on ``module.config``, refuses loss options the last stage
    does not compute (the module's ``loss_chunk_size`` / a fused ``loss_impl`` / ``z_loss_weight``, the data's
    ``document_masking``), and checks the micro-batch count against ``datamodule.micro_batch_size``
    (:func:`validate_microbatches`).

    Raises:
        MeshConfigError: naming the field, as above.
    """
    if pp == 1:
        return
    vlm_arch = _vlm_arch(module)
    if vlm_arch is not None and getattr(datamodule, "max_frames", None) is not None:
        raise MeshConfigError(f"pp={pp} with {type(datamodule).__name__}: {VIDEO_REFUSAL}.")
    cfg = module.config
    validate_pipeline_model(
        pp,
        virtual_stages,
        split_points,
        n_layers=cfg.n_layers,
        num_experts=cfg.num_experts,
        tie_embeddings=cfg.tie_embeddings,
        vlm_arch=vlm_arch,
        ep=ep,
        schedule=schedule,
        tp=tp,
    )
    for field, value in (
        ("model.loss_chunk_size", getattr(module, "loss_chunk_size", 0)),
        # the fused head + loss: the last stage computes the loss from logits (auto resolves to torch there)
        ("model.loss_impl", getattr(module, "loss_impl", "auto") in ("chunked", "liger") and module.loss_impl),
        ("model.z_loss_weight", getattr(module, "z_loss_weight", 0.0)),
        # the data module's own name for it (ChatDataModule: data.packing, a property behind document_masking)
        (
            getattr(datamodule, "document_masking_field", "data.document_masking"),
            getattr(datamodule, "document_masking", False),
        ),
    ):
        if value:
            raise MeshConfigError(f"{field}={value} is not supported with pp={pp}; turn it off or use pp=1.")
    n_micro = resolve_microbatches(microbatches, pp, virtual_stages)
    validate_microbatches(getattr(datamodule, "micro_batch_size", None), n_micro, pp, schedule)


def resolve_microbatches(microbatches: int | None, pp: int, virtual_stages: int) -> int:
    """Micro-batches per step: ``microbatches`` or, when None, one per stage (``pp * virtual_stages``)."""
    return microbatches if microbatches is not None else pp * virtual_stages


def validate_microbatches(micro_batch_size: int | None, microbatches: int, pp: int, schedule: str) -> None:
    """Check the micro-batch count against the per-rank batch and the schedule.

    Args:
        micro_batch_size: sequences per data-parallel rank and step (the datamodule's ``micro_batch_size``),
            or None when unknown (only the schedule rule is checked).
        microbatches: pipeline micro-batches per step.
        pp: pipeline-parallel degree.
        schedule: one of :data:`SCHEDULES`.

    Raises:
        MeshConfigError: ``microbatches`` does not divide ``micro_batch_size``; fewer micro-batches than
            ranks for ``1f1b`` / ``zbv``; not a multiple of ``pp`` for ``interleaved_1f1b`` / ``zero_bubble``.
    """
    if micro_batch_size is not None and micro_batch_size % microbatches:
        allowed = [d for d in range(1, micro_batch_size + 1) if micro_batch_size % d == 0]
        raise MeshConfigError(
            f"pp_microbatches={microbatches} must divide data.micro_batch_size={micro_batch_size}; allowed: {allowed}."
        )
    if schedule in ("1f1b", "zbv") and microbatches < pp:
        raise MeshConfigError(f"pp_schedule={schedule!r} needs pp_microbatches >= pp={pp}, got {microbatches}.")
    if schedule in ("interleaved_1f1b", "zero_bubble") and microbatches % pp:
        raise MeshConfigError(
            f"pp_schedule={schedule!r} needs pp_microbatches to be a multiple of pp={pp}, got {microbatches}."
        )


def stage_layer_ranges(n_layers: int, n_stages: int, split_points: Sequence[int] | None = None) -> list[range]:
    """Block indices of every stage, in stage order.

    Balanced (``split_points=None``): ``n_layers // n_stages`` blocks each, the first
    ``n_layers % n_stages`` stages one more. Otherwise stage ``i`` starts at ``split_points[i-1]``.

    Example: ``stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]``.
    """
    if split_points is None:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(n_stages)]
        starts = [sum(sizes[:i]) for i in range(n_stages)]
    else:
        starts = [0, *split_points]
    ends = [*starts[1:], n_layers]
    return [range(s, e) for s, e in zip(starts, ends, strict=True)]


def stage_ids(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Stage indices held by ``pp_rank``: looped (``r, r + pp, ...``) or, for V-shaped schedules, ``r, 2pp-1-r``."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual_stages)]


def prune_to_stages(model: nn.Module, ranges: list[range], ids: list[int]) -> None:
    """Delete, in place, every module of ``model`` that none of the stages ``ids`` needs.

    ``model`` (on the meta device, before any transform) keeps its blocks ``layers.{i}`` of those
    stages under their original names, ``tok_embeddings`` only with stage 0, and ``norm`` + ``output``
    only with the last stage; the others become None. A tied head keeps ``tok_embeddings`` on the last
    stage too (its weight is the head's, under the embedding's canonical FQN: same init, same optimizer
    rule, one key in checkpoints). FQNs are unchanged, so state dicts of all ranks together are the full
    model's.
    """
    keep = {str(i) for s in ids for i in ranges[s]}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    last = len(ranges) - 1 in ids
    tied = model.output is not None and model.output.weight is model.tok_embeddings.weight
    if 0 not in ids and not (tied and last):
        model.tok_embeddings = None
    if len(ranges) - 1 not in ids:
        model.norm = None
        model.output = None


def build_schedule(name: str, stages: list[PipelineStage], microbatches: int, loss_fn: Callable) -> _PipelineSchedule:
    """The ``torch.distributed.pipelining`` schedule ``name`` over this rank's ``stages``.

    ``scale_grads=False``: ``loss_fn`` returns summed (not averaged) token losses, and the step's
    gradients are normalized once by the global target-token count
    (:class:`kempnerforge.training.loss.StepTokenNormalizer`), exactly as without pipelining.
    """
    cls = SCHEDULES[name]
    if name in SINGLE_STAGE:
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
