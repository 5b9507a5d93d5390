"""KempnerStrategy: one N-D DeviceMesh, the fixed parallel transform chain, meta-init and DCP checkpoints.

A ``ModelParallelStrategy`` subclass (Lightning 2.6). Hook order in ``Trainer.fit`` (see
NOTES-platform.md): ``setup_environment`` (process group, mesh, validation) -> the module's
``configure_model`` (on the meta device) -> ``setup`` (transform chain, ``to_empty``,
``init_weights``, optimizers) -> checkpoint restore -> training. Weights are initialized before any
restore and never after it.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from typing_extensions import override

from kempnerforge.checkpoint.compat import layout_resume_flags, model_config_diff
from kempnerforge.checkpoint.dcp_io import WEIGHTS_ONLY_KEY, CheckpointError, DCPCheckpointIO
from kempnerforge.checkpoint.sharded_state import (
    fresh_start_meta,
    load_model_and_optimizers,
    model_state,
    optimizer_state,
    unwrap_optimizer,
)
from kempnerforge.checkpoint.train_state import check_accumulation, merge_rank_state, split_rank_state
from kempnerforge.checkpoint.verify import CorruptCheckpointError, describe_failure, first_failure
from kempnerforge.parallel.activation_checkpoint import apply_ac, validate_ac
from kempnerforge.parallel.compile import apply_compile, validate_compile
from kempnerforge.parallel.context_parallel import apply_cp, validate_cp_attention, validate_cp_run
from kempnerforge.parallel.contract import (
    TiesWeights,
    ValidatesParallel,
    check_model_contract,
    check_module_contract,
)
from kempnerforge.parallel.expert_parallel import apply_ep
from kempnerforge.parallel.float8 import (
    apply_float8,
    refresh_float8_weight_scales,
    validate_float8,
    validate_float8_collectives,
)
from kempnerforge.parallel.fsdp import apply_fsdp, is_fsdp_applied, resolve_dtype
from kempnerforge.parallel.grad_clip import check_lightning_clipping
from kempnerforge.parallel.mesh import ParallelDims, ParallelMesh, validate_degrees
from kempnerforge.parallel.order import record_step
from kempnerforge.parallel.pipeline import validate_pipeline_options, validate_pipeline_run
from kempnerforge.parallel.pipeline_runner import PipelineRunner, update_validation_metrics
from kempnerforge.parallel.pipeline_tied import tied_embedding_group
from kempnerforge.parallel.precision import (
    TrueHalfInputs,
    apply_matmul_precision,
    cast_parameters_,
    check_matmul_precision,
    check_param_dtype_name,
    describe_precision,
    plugin_precision_to_param,
    resolve_param_dtype,
    true_half_dtype,
)
from kempnerforge.parallel.tensor_parallel import apply_tp, validate_sequence_parallel
from kempnerforge.resilience.auto_resume import AutoResume
from kempnerforge.resilience.first_failure import note_first_failure
from kempnerforge.resilience.ft_config import (
    FaultTolerance,
    check_accumulation_ft,
    check_fault_tolerance,
    check_fault_tolerance_run,
)
from kempnerforge.resilience.rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT_S, expected_world, rendezvous
from kempnerforge.strategies import replica_steps
from kempnerforge.strategies.cpu_malloc import keep_freed_memory
from kempnerforge.strategies.stop_on_signal import take_over_signals

log = logging.getLogger(__name__)


class KempnerStrategy(ModelParallelStrategy):
    """Lightning strategy for FSDP2 (and, as they land, TP / EP / FP8 / AC / compile) on one DeviceMesh.

    The LightningModule and its model must fulfil the contract in :mod:`kempnerforge.parallel.contract`
    (``model`` and ``init_seed`` on the module; ``layers``, ``init_weights(seed)`` and, for ``tp > 1``,
    ``tp_plan()`` on the model; optional ``validate_parallel(dims)``, ``tie_weights()``, ``fsdp_units()``,
    MoE layers); it is checked once, with one :class:`~kempnerforge.parallel.contract.ModelContractError`
    naming what is missing, before the chain runs.

    Signals (SIGTERM, SIGUSR1, SIGINT) are handled by a flag-only :class:`~kempnerforge.callbacks.Preemption` in
    every run (one is added when none is configured; :mod:`kempnerforge.strategies.stop_on_signal`): Lightning's own
    handlers, which broadcast inside the signal handler, and its per-step SIGTERM broadcast never run here.

    Args:
        dp_replicate: data-parallel replicas (HSDP when > 1 together with ``dp_shard`` > 1).
        dp_shard: FSDP2 shard degree; -1 infers it from the world size.
        tp: tensor-parallel degree (Megatron-LM, arXiv:1909.08053): the model's ``tp_plan()`` is applied
            over the ``tp`` axis first in the chain (:func:`kempnerforge.parallel.tensor_parallel.apply_tp`).
            Must divide ``n_heads`` and ``n_kv_heads``. TP ranks of one data shard see identical batches.
        sequence_parallel: with ``tp > 1``, shard norms and the residual stream along the sequence
            (arXiv:2205.05198); needs ``seq_len % tp == 0``. Refused with ``tp=1``.
        loss_parallel: with ``tp > 1``, keep the logits vocab-sharded and compute cross-entropy on the
            shards (``torch.distributed.tensor.parallel.loss_parallel``, forward and backward);
            False all-gathers the full ``(batch, seq, vocab)`` logits on every TP rank instead (always
            the case with ``pp > 1``: the pipeline's shape inference cannot run the vocab-parallel backward).
        pp: pipeline-parallel degree (dense decoders; :mod:`kempnerforge.parallel.pipeline`): the blocks
            are split into ``pp * pp_virtual_stages`` stages, each with its own TP -> FP8 -> AC -> FSDP2
            chain; the schedule runs every micro-batch's forward and backward inside Lightning's
            ``training_step``. Not with MoE, tied embeddings, vision-language models, ``loss_chunk_size``.
        pp_schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble`` (interleaved zero bubble)
            or ``zbv`` (zero bubble, V placement, 2 virtual stages).
        pp_microbatches: pipeline micro-batches per step (must divide ``data.micro_batch_size``;
            None: one per stage).
        pp_virtual_stages: stages per rank (1 for ``gpipe`` / ``1f1b``; ``interleaved_1f1b`` >= 1).
        pp_split_points: first block index of every stage after the first (None: balanced by layer count).
        cp: context-parallel degree (:mod:`kempnerforge.parallel.context_parallel`): each sequence is split over
            ``cp`` ranks in the load-balanced zigzag layout; parameters are FSDP2-sharded over ``dp_shard x cp``.
            Needs ``seq_len % (2 * cp) == 0``; composes with ``pp`` (every stage gets the share's positions) and
            ``ep`` (which then borrows from ``dp_shard x cp``); not with vision-language models (yet).
        cp_attention: how a cp rank attends over the whole sequence: ``allgather`` (default; K/V all-gathered per
            block, any mask, any device) or ``ring`` (refused in this build).
        ep: expert-parallel degree (MoE models; borrows ranks from dp_shard, or dp_shard x cp with cp > 1, and
            must divide it and num_experts).
        mixed_precision_param: FSDP2 compute dtype of unsharded parameters (``MixedPrecisionPolicy.param_dtype``;
            the sharded master weights, gradients and optimizer state stay fp32): ``"auto"`` (bf16 on CUDA, fp32
            on CPU), ``"bfloat16"`` or ``"float32"``. Lightning's ``trainer.precision`` maps onto it (see
            :mod:`kempnerforge.parallel.precision`): ``32-true`` (the default) keeps this setting,
            ``bf16-mixed`` is the same as ``"bfloat16"`` (no autocast), every other value is refused.
        mixed_precision_reduce: FSDP2 gradient reduction dtype, "float32" or "bfloat16".
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` on CUDA: ``"high"`` (default: TF32
            tensor cores for the fp32 matmuls left, e.g. under ``mixed_precision_param=float32``),
            ``"highest"`` (opt out: full fp32) or ``"medium"``. Not applied on CPU.
        reshard_after_forward: FSDP2 frees gathered parameters after forward (saves memory, one more all-gather).
        process_group_backend: "gloo", "nccl" or None (None: nccl on CUDA, gloo on CPU).
        timeout: collective timeout.
        float8_recipe: None (FP8 off) or a torchao float8 training recipe, ``"tensorwise"`` or
            ``"rowwise"`` (validated against the installed torchao; needs the ``float8`` extra).
            Converts Linears whose dims are multiples of 16, except experts, routers and the head. With
            ``tp > 1`` the TP-sharded Linears use torchao's float8 TP styles (tensorwise: float8 collectives)
            or the stock ones (rowwise: high-precision collectives), see :mod:`kempnerforge.parallel.float8`.
        float8_all_gather: FSDP2 all-gathers weights in float8 (``float8_recipe="tensorwise"`` only).
        activation_checkpointing: ``"none"``, ``"full"`` (every block), ``"selective"`` (every
            ``ac_every_n``-th block) or ``"selective_op"`` (every block; matmul, attention and router
            top-k outputs are saved, the rest recomputed; arXiv:2205.05198).
        ac_every_n: with ``activation_checkpointing="selective"``, checkpoint every n-th block (>= 1).
        compile: ``torch.compile`` each block in place (after AC, before FSDP2). With ``ep > 1`` MoE blocks are
            compiled piecewise around their FSDP2 units (:func:`~kempnerforge.parallel.compile.apply_compile`).
        compile_backend: the ``torch.compile`` backend: ``"inductor"`` (default: generated kernels),
            ``"aot_eager"`` (traced forward and backward graphs run by eager kernels: no code generation, for
            CPU tests) or ``"eager"`` (dynamo only).
        cpu_keep_freed_memory: on CPU, tell glibc malloc to keep freed memory for the next step
            instead of unmapping it (:func:`kempnerforge.strategies.cpu_malloc.keep_freed_memory`):
            ~30% faster CPU steps for one model training alone (the debug recipe turns it on), but
            the heap can fragment and grow when several models with different shapes allocate in one
            process, so it is off by default. No effect on CUDA runs.
        async_checkpoint: the training thread only copies each rank's shards to host memory (DCP's
            ``DefaultStager``: pinned buffers on CUDA, allocated in the background after the first optimizer step
            when a ``ModelCheckpoint`` will save); DCP writes them in the background, and the
            ``COMPLETE`` marker and ``latest`` move as soon as every rank's shards are written
            (:class:`~kempnerforge.checkpoint.dcp_io.DCPCheckpointIO` ``async_save``).
        rendezvous_timeout_s: seconds the ranks wait for each other at the start (> 0); then the run fails
            with the joined and expected counts and the setting the count comes from
            (:func:`~kempnerforge.resilience.rendezvous.rendezvous`). ``timeout`` covers the collectives after.
        fault_tolerance: replica groups managed by torchft (the ``ft`` extra;
            :class:`~kempnerforge.resilience.ft_config.FaultTolerance`): this job is one group of several, each its
            own world with ``dp_replicate=1``; gradients are summed over the groups alive at each step, a step commits
            only when they agree, and a (re)joining group heals from a live one (:mod:`.replica_steps`). None: off.

    Raises:
        MeshConfigError: ``sequence_parallel=True`` with ``tp=1`` (at construction); in
            ``setup_environment`` when degrees do not fit the world size, the model (``n_heads % tp``,
            ``n_kv_heads % tp``) or the data (``seq_len % tp`` with sequence parallel).
        ModelContractError: the module or its model lacks what the strategy needs (in ``setup_environment``
            and ``setup``; :mod:`kempnerforge.parallel.contract`).
        ValueError: an unknown dtype name, activation-checkpointing mode or ``ac_every_n`` < 1; when the
            Trainer is built, a ``trainer.precision`` other than ``32-true`` / ``bf16-mixed`` (one line naming
            ``trainer.strategy.init_args.mixed_precision_param``); in ``setup_environment``, before the process
            group exists, ``trainer.gradient_clip_val`` (clipping is the module's ``grad_clip``).
        Float8ConfigError: an unknown float8 recipe, torchao missing, or ``float8_all_gather`` with a
            non-tensorwise recipe.
    """

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        cp_attention: str = "allgather",
        sequence_parallel: bool = False,
        loss_parallel: bool = True,
        mixed_precision_param: str = "auto",
        mixed_precision_reduce: str = "float32",
        float32_matmul_precision: str = "high",
        reshard_after_forward: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        float8_recipe: str | None = None,
        float8_all_gather: bool = False,
        activation_checkpointing: str = "none",
        ac_every_n: int = 2,
        compile: bool = False,
        compile_backend: str = "inductor",
        cpu_keep_freed_memory: bool = False,
        async_checkpoint: bool = False,
        pp_schedule: str = "1f1b",
        pp_microbatches: int | None = None,
        pp_virtual_stages: int = 1,
        pp_split_points: list[int] | None = None,
        rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        super().__init__(
            data_parallel_size=1,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._degrees = {
            "dp_replicate": dp_replicate,
            "dp_shard": dp_shard,
            "tp": tp,
            "pp": pp,
            "cp": cp,
            "ep": ep,
        }
        # Validate what needs no world size now, so a bad config fails before any process starts.
        validate_degrees(**self._degrees)
        check_fault_tolerance(fault_tolerance, self._degrees)
        self.fault_tolerance = fault_tolerance
        self.replica_groups: Any = None  # ReplicaGroups from setup() of a fit on (its process group exists then)
        for name, flag in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r} is not allowed; use True or False.")
        validate_sequence_parallel(tp, sequence_parallel)
        validate_cp_attention(cp_attention)
        self.cp_attention = cp_attention
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        check_param_dtype_name(mixed_precision_param)
        check_matmul_precision(float32_matmul_precision)
        self.mixed_precision_param = mixed_precision_param  # trainer.precision=bf16-mixed may set "bfloat16"
        self.true_half: torch.dtype | None = None  # trainer.precision=bf16-true / 16-true: the parameters' dtype
        self.restored: tuple[Path, int | None] | None = None  # the checkpoint fit resumed from, and its step
        self.reduce_dtype = resolve_dtype(mixed_precision_reduce, "mixed_precision_reduce")
        self.float32_matmul_precision = float32_matmul_precision
        self.reshard_after_forward = reshard_after_forward
        validate_float8(float8_recipe, float8_all_gather)
        validate_ac(activation_checkpointing, ac_every_n)
        validate_compile(compile, compile_backend)
        self.float8_recipe = float8_recipe
        self.float8_all_gather = float8_all_gather
        self.activation_checkpointing = activation_checkpointing
        self.ac_every_n = ac_every_n
        self.compile = compile
        self.compile_backend = compile_backend
        self.cpu_keep_freed_memory = cpu_keep_freed_memory
        self.parallel_mesh: ParallelMesh | None = None
        self._layout_pending = False  # setup_environment ran without a module: setup validates the mesh against it
        self._checkpoint_io = DCPCheckpointIO(async_save=async_checkpoint, timeout=timeout)
        self._failure: BaseException | None = None
        self._prestaged = False  # async_checkpoint: the staging buffers were allocated (once per fit)
        validate_pipeline_options(pp, pp_schedule, pp_microbatches, pp_virtual_stages, pp_split_points)
        self.pp_options = {
            "schedule": pp_schedule,
            "microbatches": pp_microbatches,
            "virtual_stages": pp_virtual_stages,
            "split_points": pp_split_points,
        }
        self.pipeline: PipelineRunner | None = None
        if not isinstance(rendezvous_timeout_s, int | float) or not rendezvous_timeout_s > 0:
            raise ValueError(f"rendezvous_timeout_s={rendezvous_timeout_s!r} must be a number of seconds > 0.")
        self.rendezvous_timeout_s = float(rendezvous_timeout_s)
        #: The device type the run's device-dependent settings resolve for (``auto`` precision), when it is not the
        #: one the strategy runs on: ``kforge estimate`` simulates CUDA ranks on CPU and sets ``"cuda"``.
        self.target_device_type: str | None = None

    # -- precision ------------------------------------------------------------------------------

    @property
    def precision_device_type(self) -> str:
        """The device type ``auto`` precision resolves for: :attr:`target_device_type`, else the root device's."""
        return self.target_device_type or self.root_device.type

    @property
    @override
    def precision_plugin(self) -> Precision:
        """Lightning's precision plugin: always the plain one here (the policy is FSDP2's, see ``param_dtype``)."""
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning's accelerator connector sets the plugin it built from trainer.precision while the Trainer is
        # constructed (no process group yet): bf16-mixed becomes the FSDP2 policy, anything else but 32-true is
        # refused (kempnerforge.parallel.precision), so autocast never runs on top of sharded fp32 parameters.
        if plugin is not None:
            self.mixed_precision_param = plugin_precision_to_param(plugin, self.mixed_precision_param)
            name = getattr(plugin, "precision", None)
            self.true_half = true_half_dtype(name) if type(plugin) is not Precision else None
            if self.true_half is not None and self.float8_recipe is not None:
                raise ValueError(
                    f"trainer.precision={name!r} cannot be combined with float8_recipe (Float8Linear keeps fp32 "
                    "weights and casts them itself); use trainer.precision=bf16-mixed with FP8."
                )
            plugin = TrueHalfInputs(name) if self.true_half is not None else Precision()
        self._precision_plugin = plugin

    @property
    def param_dtype(self) -> torch.dtype:
        """FSDP2 compute dtype (``mixed_precision_param`` resolved on this strategy's device: ``auto`` is bf16 on CUDA;
        under ``bf16-true`` / ``16-true`` the parameters' own dtype)."""
        if self.true_half is not None:
            return self.true_half
        return resolve_param_dtype(self.mixed_precision_param, self.precision_device_type)

    def describe_precision(self) -> str:
        """The precision line logged with the mesh (compute, master weights, reduction, fp32 matmuls)."""
        device = self.precision_device_type
        return describe_precision(
            self.param_dtype, self.reduce_dtype, self.float32_matmul_precision, device, self.true_half
        )

    # -- environment and mesh -------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        """Refuse Lightning's own clipping, take over the signal handling (:mod:`.stop_on_signal`), initialize the
        process group, set the fp32 matmul precision (CUDA), then build the world mesh and validate it against the
        module (:meth:`attach_layout`). Without a module attached yet (Lightning's own ModelParallelStrategy tests
        set strategies up that way) the module's half waits for :meth:`setup`."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is not None:
            check_lightning_clipping(trainer.gradient_clip_val)  # before any rendezvous
            check_accumulation_ft(self.fault_tolerance, trainer.accumulate_grad_batches)
            take_over_signals(trainer)  # before fit registers Lightning's handlers
        # The parent's setup_environment would build its own 2-D mesh; its process-group half is this private method.
        self._setup_distributed()
        apply_matmul_precision(self.float32_matmul_precision, self.root_device.type)
        if self.cpu_keep_freed_memory and self.root_device.type == "cpu":
            keep_freed_memory()
        if module is not None:
            self.attach_layout(module, getattr(trainer, "datamodule", None))
        else:  # the mesh from the degrees alone; setup validates it against the module when it is attached
            self.parallel_mesh = ParallelDims(**self._degrees, world_size=self.world_size).build_mesh(
                self.root_device.type
            )
            self._device_mesh = self.parallel_mesh.world
            self._layout_pending = True

    def attach_layout(self, module: Any, datamodule: Any) -> None:
        """Validate the degrees against the world, the module and the data (:meth:`check_layout`), build the world
        mesh (and the pipeline runner for ``pp > 1``) and log it with the precision policy.

        Raises:
            MeshConfigError / ValueError / ModelContractError: as :meth:`check_layout`.
        """
        dims = self.check_layout(self.world_size, module, datamodule)
        if self.parallel_mesh is None or self.parallel_mesh.dims != dims:
            self.parallel_mesh = dims.build_mesh(self.root_device.type)
        self._layout_pending = False
        if dims.pp > 1:
            if dims.tp > 1 and self.loss_parallel:
                # The pipeline's shape inference cannot run the vocab-parallel loss backward: gather the logits.
                rank_zero_info("pp > 1 with tp > 1: loss_parallel is off (the last stage all-gathers the logits).")
                self.loss_parallel = False
            n_layers = module.config.n_layers
            self.pipeline = PipelineRunner(self.parallel_mesh.pp, n_layers, **self.pp_options)
            if module.config.tie_embeddings:  # every rank joins the first/last-stage groups
                self.pipeline.tied_group = tied_embedding_group(self.parallel_mesh.world)
        self._device_mesh = self.parallel_mesh.world
        module._device_mesh = self._device_mesh  # as ModelParallelStrategy does (no public setter)
        rank_zero_info(f"{self.parallel_mesh.describe()}; {self.describe_precision()}")
        log.debug(self.parallel_mesh.describe())

    def check_layout(self, world_size: int, module: Any, datamodule: Any) -> ParallelDims:
        """Every parallel rule that needs only the world size, the module and the data, not a process group:
        degrees against ``world_size``, the module's ``validate_parallel`` (``n_heads % tp``, MoE rules), sequence
        parallelism against ``seq_len`` and the pipeline options. ``kforge`` calls it before the rendezvous
        (:mod:`kempnerforge.preflight`), :meth:`setup_environment` again once the world exists.

        Raises:
            MeshConfigError / ValueError: the rule that fails, naming the degree and the allowed values.
            ModelContractError: the module lacks ``model`` or ``init_seed``.
        """
        check_module_contract(module)
        dims = ParallelDims(**self._degrees, world_size=world_size)
        if isinstance(module, ValidatesParallel):
            module.validate_parallel(dims)
        seq_len = getattr(datamodule, "seq_len", None)
        validate_sequence_parallel(dims.tp, self.sequence_parallel, seq_len)
        validate_cp_run(
            dims.cp,
            self.cp_attention,
            module,
            seq_len,
            self._planned_backend(),
            tp=dims.tp,
            sequence_parallel=self.sequence_parallel,
        )
        validate_pipeline_run(dims.pp, module, datamodule, **self.pp_options, ep=dims.ep, tp=dims.tp)
        validate_float8_collectives(self.float8_recipe, dims.tp, self.sequence_parallel, self._planned_backend())
        check_fault_tolerance_run(self.fault_tolerance, module, datamodule)
        return dims

    def _planned_backend(self) -> str | None:
        # The backend _setup_distributed will pick (Lightning's rule: the explicit one, else by device type).
        if self._process_group_backend is not None:
            return self._process_group_backend
        if not self.parallel_devices:  # a bare strategy, before the Trainer assigns its devices
            return None
        return self._get_process_group_backend()

    @override
    def _setup_distributed(self) -> None:
        """``ModelParallelStrategy._setup_distributed`` with a timed rendezvous first: with more than one rank the
        job's TCPStore comes from :func:`~kempnerforge.resilience.rendezvous.rendezvous` (which fails after
        ``rendezvous_timeout_s`` naming the joined / expected counts) and is handed to ``init_process_group``."""
        ParallelStrategy.setup_environment(self)  # what the parent's super().setup_environment() runs
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        kwargs["device_id"] = self.root_device if self.root_device.type != "cpu" else None
        if self.world_size > 1 and not torch.distributed.is_initialized():
            env = self.cluster_environment
            world = expected_world(self)
            kwargs["store"] = rendezvous(
                env.main_address, env.main_port, world, self.rendezvous_timeout_s, self._timeout
            )
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Sampler rank and size from the data-parallel axes only (TP/CP ranks see the same batches); with
        fault tolerance the replica group is one more data-parallel coordinate (group ``g`` of ``G``, dp rank ``d`` of
        ``D``: shard ``g * D + d`` of ``G * D``)."""
        assert self.parallel_mesh is not None
        dp, rank = self.parallel_mesh.dp.size(), self.parallel_mesh.dp_rank
        if self.fault_tolerance is not None:
            ft = self.fault_tolerance
            return {"num_replicas": ft.num_replica_groups * dp, "rank": ft.replica_group_id * dp + rank}
        return {"num_replicas": dp, "rank": rank}

    # -- the transform chain and materialization -----------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        """Apply the chain (once), materialize meta tensors, run ``init_weights``, then Lightning's setup."""
        module = self.lightning_module
        model: nn.Module = module.model
        if self._layout_pending:  # setup_environment ran before the module was attached
            self.attach_layout(module, getattr(trainer, "datamodule", None))
            take_over_signals(trainer)
        assert self.parallel_mesh is not None
        check_model_contract(model, tp=self.parallel_mesh.dims.tp)
        if not is_fsdp_applied(model):
            self.parallelize(model)
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            self.materialize(model, seed=module.init_seed)
        if self.pipeline is not None and self.pipeline.schedule is None:
            self.pipeline.build(self.root_device)
        super().setup(trainer)
        self._refresh_float8_scales()  # after Lightning's setup: scales set before it were found lost after it
        if self.fault_tolerance is not None and self.replica_groups is None and trainer.state.fn == "fit":
            self.replica_groups = replica_steps.connect(self)  # validate / test need no quorum
            replica_steps.attach(self, trainer)

    def parallelize(self, model: nn.Module) -> None:
        """The chain in its fixed order: TP -> CP -> EP -> FP8 -> activation checkpointing -> compile -> FSDP2."""
        assert self.parallel_mesh is not None
        if self.pipeline is not None:
            self.pipeline.prune(model)  # on meta: this rank keeps only its stages' modules
        # bf16-true / 16-true first: every transform after it (TP's DTensors, FSDP2's shards) keeps the 16-bit storage.
        if self.true_half is not None:
            cast_parameters_(model, self.true_half)
        # TP first: its plan matches raw nn.Linear / nn.Embedding modules by FQN (any wrapper hides them). With FP8
        # the Linears it shards become Float8Linear just before (torchao's float8 styles need them; same FQNs).
        if self.parallel_mesh.dims.tp > 1:
            apply_tp(
                model,
                self.parallel_mesh.tp,
                sequence_parallel=self.sequence_parallel,
                loss_parallel=self.loss_parallel,
                float8_recipe=self.float8_recipe,
                float8_all_gather=self.float8_all_gather,
            )
        # CP after TP (any time before compile): marks the attention modules, whatever TP made of them.
        apply_cp(model, self.parallel_mesh.cp if self.parallel_mesh.dims.cp > 1 else None)
        # EP after TP: splits the experts' dim 0 over the ep mesh (TP split their hidden channels: expert-TP).
        ep = self.parallel_mesh.dims.ep
        apply_ep(model, self.parallel_mesh.ep if ep > 1 else None)
        # FP8 after TP/EP, before AC/FSDP2: the filter must see raw Linears by FQN (those TP did not convert), and
        # FSDP2 can only all-gather in float8 if conversion came first.
        apply_float8(model, self.float8_recipe, self.float8_all_gather)
        # AC before compile and FSDP2: wrapping after FSDP2 owns the parameters breaks its buckets.
        apply_ac(model, self.activation_checkpointing, self.ac_every_n)
        # Per-block compile after AC (the recompute is compiled too), before FSDP2 (its hooks stay outside; with EP
        # the MoE blocks are compiled piecewise around the MoE / experts units FSDP2 will make inside them).
        apply_compile(
            model,
            enabled=self.compile,
            backend=self.compile_backend,
            expert_parallel=ep > 1,
            tensor_parallel=self.parallel_mesh.dims.tp > 1,
        )
        # FSDP2 last: embedding, blocks, [norm, head] (tied: one unit with the embedding), root. With pp > 1
        # every stage is a root and keeps its parameters gathered: each micro-batch reuses them.
        sp_degree = self.parallel_mesh.dims.tp if self.sequence_parallel else 1
        units = self.pipeline.make_stages(model, sp_degree) if self.pipeline is not None else [model]
        for unit in units:
            apply_fsdp(
                unit,
                self.parallel_mesh.fsdp,
                param_dtype=self.param_dtype,
                reduce_dtype=self.reduce_dtype,
                reshard_after_forward=self.reshard_after_forward and self.pipeline is None,
                expert_mesh=self.parallel_mesh.expert_fsdp if ep > 1 else None,
            )
        if self.pipeline is not None:
            record_step(model, "fsdp")

    def _refresh_float8_scales(self) -> None:
        """With ``float8_all_gather``: the weights' float8 scales from the current weights, one all-reduce for all
        (:func:`~kempnerforge.parallel.float8.refresh_float8_weight_scales`); exact full-tensor amax under TP."""
        module = self.lightning_module
        if self.float8_all_gather and module is not None:
            refresh_float8_weight_scales(module.model)

    def materialize(self, model: nn.Module, seed: int) -> None:
        """Allocate meta tensors on the device and run the model's own init (the only init)."""
        if self.pipeline is not None:
            self.pipeline.materialize(model, self.root_device, seed)
            return
        model.to_empty(device=self.root_device)
        if isinstance(model, TiesWeights):
            model.tie_weights()
        with torch.no_grad():
            model.init_weights(seed=seed)

    # -- checkpoints ----------------------------------------------------------------------------

    @property
    @override
    def checkpoint_io(self) -> DCPCheckpointIO:
        """The DCP checkpoint layout (see :mod:`kempnerforge.checkpoint.dcp_io`); used for every save and load."""
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        if io is not None and not isinstance(io, DCPCheckpointIO):
            raise TypeError(f"KempnerStrategy needs a DCPCheckpointIO (or a subclass), got {type(io).__name__}.")
        if io is not None:
            self._checkpoint_io = io

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's sharded state on its device (no ``cpu_offload`` copy on the training thread: the
        checkpoint IO stages it, see :func:`~kempnerforge.checkpoint.sharded_state.model_state`)."""
        assert self.model is not None
        return model_state(self.model)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's sharded state, flattened per parameter FQN (loads under another pp degree)."""
        assert self.model is not None
        return optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        """Every rank writes its shards and its own RNG / dataloader state; rank 0 writes metadata."""
        path = Path(self.broadcast(str(filepath)))
        assert self.parallel_mesh is not None
        dp = self.parallel_mesh.dp
        checkpoint["rank_state"] = split_rank_state(checkpoint, dp.get_local_rank(), dp.size())
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        checkpoint["rank_state"]["accumulate_grad_batches"] = getattr(trainer, "accumulate_grad_batches", None)
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore model and optimizer shards in place (resharding), then return Lightning's metadata.

        The path is global rank 0's, broadcast. Every rank then checks the files it reads, and only those
        (:func:`~kempnerforge.checkpoint.verify.verify_rank_files`, then its DCP read plan's shards), and one
        all-reduce combines the verdicts: no rank reads another rank's files for it, nor waits while one does. For
        ``--ckpt_path auto`` (:class:`~kempnerforge.resilience.auto_resume.AutoResume`) rank 0 alone picks the
        newest complete checkpoint, and when there is none every rank starts fresh (metadata that restores
        nothing). A pick whose files are bad on any rank is rejected on all of them with a warning naming the file,
        and the next one is restored from scratch, so nothing of the failed attempt survives (model and optimizer
        state are overwritten whole, loops and RNG come from the new metadata).

        Raises:
            CorruptCheckpointError: an explicit path whose files are missing, truncated or unreadable (names the
                file); with ``auto``, when every complete checkpoint is.
            CheckpointError: the path is not a complete checkpoint, or it was written by another model.
        """
        if self.fault_tolerance is not None:
            checkpoint_path = replica_steps.group_auto_resume(checkpoint_path, self.fault_tolerance)
        while True:
            chosen = self._agreed_checkpoint_path(checkpoint_path)
            if chosen is None:
                self.lightning_module.trainer.ckpt_path = None  # Lightning then reports no restore
                return fresh_start_meta()
            try:
                return self._restore(Path(chosen))
            except CorruptCheckpointError as err:  # raised on every rank alike (see _restore)
                if not isinstance(checkpoint_path, AutoResume):
                    raise
                checkpoint_path.reject(chosen, str(err))
                rank_zero_warn(f"Auto-resume: {err}; restoring the previous complete checkpoint instead.")

    def _restore(self, path: Path) -> dict[str, Any]:
        """Every rank: the files it reads before DCP (``.metadata``, ``meta.pt``, its state file:
        :func:`~kempnerforge.checkpoint.verify.verify_rank_files`), agreed across ranks by one all-reduce, then the
        DCP shards (each rank checks its read plan's files before using them; DCP agrees on a failure itself).

        Raises:
            CorruptCheckpointError: on every rank when any rank's files do not load, or DCP could not read a shard.
        """
        assert self.model is not None and self.parallel_mesh is not None
        meta: dict[str, Any] = {}
        local: CheckpointError | None = None
        try:
            path = self.checkpoint_io.resolve(path)
            meta = self.checkpoint_io.load_checkpoint(path)
        except CheckpointError as err:  # this rank only: agree first, so no rank enters DCP's collectives alone
            local = err
        self._agree_no_failure(local, path)
        # An imported checkpoint (kforge convert hf-to-dcp) holds weights only: optimizer, schedule,
        # loops and data position start fresh.
        weights_only = bool(meta.pop(WEIGHTS_ONLY_KEY, False))
        try:
            load_model_and_optimizers(
                self.model,
                [] if weights_only else self.optimizers,
                path,
                self.checkpoint_io,
                strict=self.lightning_module.strict_loading,
            )
        except (RuntimeError, ValueError, CheckpointException) as err:  # missing / mis-shaped tensors: say why
            diff = model_config_diff(meta.get("hyper_parameters"), self.lightning_module.hparams)
            flags = layout_resume_flags(meta.get("hyper_parameters"), self.lightning_module.hparams)
            if flags:  # the same network with separate (or fused) projections: say how to resume it
                raise CheckpointError(
                    f"{path} holds the same model with its projections laid out differently ({'; '.join(diff)}): "
                    f"checkpoints written before fused projections became the default hold the separate wq/wk/wv "
                    f"and w1/w3. Resume it with {' '.join(flags)}."
                ) from err
            if diff:
                raise CheckpointError(
                    f"{path} was written by another model ({'; '.join(diff[:8])}), so it cannot be resumed into "
                    "this one. Start fresh with --ckpt_path null, or give this run its own checkpoint folder "
                    "(ModelCheckpoint / Preemption dirpath): --ckpt_path auto resumes the newest checkpoint there."
                ) from err
            if isinstance(first_failure(err), CorruptCheckpointError):  # DCP raises on every rank alike
                raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {describe_failure(err)}") from err
            raise
        self._refresh_float8_scales()  # the restored weights' scales
        if weights_only:
            meta.pop("rank_state", None)
            return meta
        dp = self.parallel_mesh.dp
        # A position saved under another dp degree is remapped exactly; the global batch must be kept.
        datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
        rank_state = meta.pop("rank_state")
        trainer = self.lightning_module.trainer
        self.restored = (path, meta.get("global_step"))  # for the "already complete" line (kempnerforge.cli)
        check_accumulation((rank_state or {}).get("accumulate_grad_batches"), trainer.accumulate_grad_batches)
        merge_rank_state(
            meta,
            rank_state,
            dp.get_local_rank(),
            dp.size(),
            getattr(datamodule, "micro_batch_size", None),
        )
        return meta

    def _agree_no_failure(self, error: BaseException | None, path: Path) -> None:
        """Every rank's verdict on its own files, combined by one all-reduce (MIN of the failing rank, the world size
        when none failed); only on a failure, that rank's error text is broadcast, and raised on all ranks.

        Raises:
            CorruptCheckpointError: the lowest failing rank's ``error``, named with its rank.
        """
        text = None if error is None else str(error)
        rank = 0
        if self.world_size > 1 and torch.distributed.is_initialized():
            mine = self.global_rank if error is not None else self.world_size
            flag = torch.tensor([mine], dtype=torch.int64, device=self.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            rank = int(flag.item())
            if rank == self.world_size:
                return
            box = [text]
            torch.distributed.broadcast_object_list(box, src=rank)
            text = box[0]
        if text is not None:
            where = f" (rank {rank})" if self.world_size > 1 else ""
            raise CorruptCheckpointError(f"checkpoint {path} cannot be loaded{where}: {text}") from error

    def _agreed_checkpoint_path(self, checkpoint_path: _PATH) -> str | None:
        """Global rank 0's decision on every rank: the checkpoint to load (None: start fresh), or its error.

        Raises:
            CheckpointError / CorruptCheckpointError: rank 0 found the path incomplete or its files bad (auto:
                every complete checkpoint of the folder bad); raised on every rank.
        """
        decision = self._decide_checkpoint(checkpoint_path) if self.is_global_zero else None
        kind, value = self.broadcast(decision)
        if kind == "corrupt":
            raise CorruptCheckpointError(value)
        if kind == "invalid":
            raise CheckpointError(value)
        return value

    def _decide_checkpoint(self, checkpoint_path: _PATH) -> tuple[str, str | None]:
        """Rank 0: ``("path", path or None)``, ``("corrupt", message)`` or ``("invalid", message)``."""
        if isinstance(checkpoint_path, AutoResume):
            choice = checkpoint_path.choose()
            if choice is not None:
                rank_zero_info(f"Auto-resume: resuming from {choice}.")
                return "path", str(choice)
            if checkpoint_path.rejected:
                reasons = "; ".join(checkpoint_path.rejected.values())
                return "corrupt", f"Auto-resume: no complete checkpoint in {checkpoint_path.folder} loads: {reasons}"
            rank_zero_info(f"Auto-resume: no complete checkpoint in {checkpoint_path.folder}; starting fresh.")
            return "path", None
        try:
            self.checkpoint_io.resolve(checkpoint_path)  # complete; its files are checked by the ranks reading them
        except CorruptCheckpointError as err:
            return "corrupt", str(err)
        except CheckpointError as err:
            return "invalid", str(err)
        return "path", str(checkpoint_path)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Remember the failure, so :meth:`teardown` makes no collective call, and put the first failing rank's
        error on this one (:func:`~kempnerforge.resilience.first_failure.note_first_failure`)."""
        self._failure = exception
        if self.world_size > 1 and torch.distributed.is_initialized():
            env = self.cluster_environment
            note_first_failure(exception, self.global_rank, env.main_address, env.main_port)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Finish the checkpoint IO's background work (``ModelParallelStrategy.teardown`` skips
        ``checkpoint_io.teardown``), then Lightning's teardown. After an exception nothing is awaited and no
        collective runs (the other ranks may be stuck in one, or gone): the error reaches the user at once."""
        failure, self._failure = self._failure, None
        self._prestaged = False
        if self.replica_groups is not None:
            self.replica_groups.shutdown()
            self.replica_groups = None
        if failure is None:
            self.checkpoint_io.teardown()
        else:
            self.checkpoint_io.abandon()
        super().teardown()

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 deletes a checkpoint directory (``ModelCheckpoint(save_top_k=...)`` rotation)."""
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    # -- pipeline parallelism (pp > 1) ------------------------------------------------------------

    @property
    def pp_group(self) -> Any:
        """The pipeline process group when ``pp > 1`` (gradient norms are summed over it), else None."""
        return self.pipeline.pp_mesh.get_group() if self.pipeline is not None else None

    @property
    def grad_norm_skip(self) -> list[torch.Tensor]:
        """Parameters the gradient norm leaves out (clipping still scales them): with ``pp > 1`` and tied
        embeddings, the last stage's copy of the embedding weight (counted once, on the first stage)."""
        return self.pipeline.norm_skip(self.lightning_module.model) if self.pipeline is not None else []

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step. With ``pp > 1`` the tied embedding's first- and last-stage gradients are
        summed once right after the step's last backward, before any ``on_before_optimizer_step`` hook; after
        the step (``float8_all_gather``) the float8 weight scales of the new weights are refreshed."""
        if self.pipeline is not None:
            pipeline, module, inner = self.pipeline, self.lightning_module, closure

            def closure() -> Any:
                out = inner()
                pipeline.finish_step_gradients(module.model)
                return out

        if self.replica_groups is not None:
            # The forward and backward first (the gradient shards are summed across groups in it), then the vote.
            result = closure()
            if not replica_steps.commit(self):
                return result

            def closure() -> Any:
                return result

        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._refresh_float8_scales()
        self._prestage_async_checkpoint()
        return out

    def _prestage_async_checkpoint(self) -> None:
        """With ``async_checkpoint`` and a ``ModelCheckpoint``, once every optimizer has state: the checkpoint IO
        allocates its host staging buffers in the background (:meth:`DCPCheckpointIO.prestage`), so no save's
        stall includes that allocation."""
        if self._prestaged or not getattr(self.checkpoint_io, "async_save", False) or self.model is None:
            return
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not getattr(trainer, "checkpoint_callbacks", None):
            return
        optimizers = [unwrap_optimizer(o) for o in self.optimizers]
        if not optimizers or not all(o.state for o in optimizers):
            return
        self._prestaged = True
        sharded = {"state_dict": self.lightning_module_state_dict()}
        for i, optimizer in enumerate(optimizers):
            sharded[f"optimizer_{i}"] = self.optimizer_state(optimizer)
        self.checkpoint_io.prestage(sharded)

    @override
    def on_train_start(self) -> None:
        """With fault tolerance: the first quorum, and a heal from a live group when this one is behind
        (:func:`.replica_steps.first_quorum`), before the training loader starts."""
        super().on_train_start()
        if self.replica_groups is not None:
            replica_steps.first_quorum(self)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """With fault tolerance: ask for this step's quorum (it forms while the forward runs)."""
        super().on_train_batch_start(batch, batch_idx)
        if self.replica_groups is not None:
            self.replica_groups.start_step()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """With ``pp > 1``: the schedule runs forward and backward of every micro-batch here; the
        returned loss (detached) goes through the module's normal step accounting and logging."""
        if self.pipeline is None:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return self.pipeline.training_step(self.lightning_module, args[0], args[1])

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """With ``pp > 1`` the schedule already ran the backward: only the hooks run (on_before/after_backward)."""
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.pipeline.restore_grads(self.lightning_module.model)  # the schedule's, set aside in training_step
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """With ``pp > 1``: a forward-only pipeline pass; the last stage's loss feeds ``val/loss`` and
        ``val/ppl`` on every rank."""
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        loss_sum, n_targets = self.pipeline.eval_step(self.lightning_module, args[0])  # this cp rank's share
        update_validation_metrics(self.lightning_module, loss_sum, n_targets)
        return None
