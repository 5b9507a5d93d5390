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
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from kempnerforge.checkpoint.dcp_io import DCPCheckpointIO
from kempnerforge.checkpoint.sharded_state import load_model_and_optimizers
from kempnerforge.checkpoint.train_state import merge_rank_state, split_rank_state
from kempnerforge.parallel.fsdp import apply_fsdp, is_fsdp_applied, resolve_dtype
from kempnerforge.parallel.mesh import ParallelDims, ParallelMesh, validate_degrees

log = logging.getLogger(__name__)


class KempnerStrategy(ModelParallelStrategy):
    """Lightning strategy for FSDP2 (and, as they land, TP / EP / FP8 / AC / compile) on one DeviceMesh.

    The LightningModule must expose ``model`` (an ``nn.Module`` with ``layers`` and
    ``init_weights(seed)``), ``init_seed`` and optionally ``validate_parallel(dims)`` that checks
    model-specific rules (e.g. ``n_heads % tp``) before anything is allocated.

    Args:
        dp_replicate: data-parallel replicas (HSDP when > 1 together with ``dp_shard`` > 1).
        dp_shard: FSDP2 shard degree; -1 infers it from the world size.
        tp: tensor-parallel degree (refused until the TP step lands).
        pp: pipeline-parallel degree (refused until pipelining lands).
        cp: context-parallel degree (refused: not implemented).
        ep: expert-parallel degree (refused until MoE lands).
        mixed_precision_param: FSDP2 compute dtype of unsharded parameters, "float32" or "bfloat16".
        mixed_precision_reduce: FSDP2 gradient reduction dtype, "float32" or "bfloat16".
        reshard_after_forward: FSDP2 frees gathered parameters after forward (saves memory, one more all-gather).
        process_group_backend: "gloo", "nccl" or None (None: nccl on CUDA, gloo on CPU).
        timeout: collective timeout.

    Raises:
        MeshConfigError: in ``setup_environment`` when degrees do not fit the world size or the model.
        ValueError: an unknown dtype name.
    """

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        mixed_precision_param: str = "float32",
        mixed_precision_reduce: str = "float32",
        reshard_after_forward: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=1,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
        # Validate what needs no world size now, so a bad config fails before any process starts.
        validate_degrees(**self._degrees)
        self.param_dtype = resolve_dtype(mixed_precision_param, "mixed_precision_param")
        self.reduce_dtype = resolve_dtype(mixed_precision_reduce, "mixed_precision_reduce")
        self.reshard_after_forward = reshard_after_forward
        self.parallel_mesh: ParallelMesh | None = None
        self._checkpoint_io = DCPCheckpointIO()

    # -- environment and mesh -------------------------------------------------------------------

    def setup_environment(self) -> None:
        """Initialize the process group, validate the degrees, build the world mesh and log it."""
        self._setup_distributed()
        dims = ParallelDims(**self._degrees, world_size=self.world_size)
        validate = getattr(self.lightning_module, "validate_parallel", None)
        if callable(validate):
            validate(dims)
        self.parallel_mesh = dims.build_mesh(self.root_device.type)
        self._device_mesh = self.parallel_mesh.world
        self.lightning_module._device_mesh = self._device_mesh
        rank_zero_info(self.parallel_mesh.describe())
        log.debug(self.parallel_mesh.describe())

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Sampler rank and size from the data-parallel axes only (TP/CP ranks see the same batches)."""
        assert self.parallel_mesh is not None
        return {"num_replicas": self.parallel_mesh.dp.size(), "rank": self.parallel_mesh.dp_rank}

    # -- the transform chain and materialization -----------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Apply the chain (once), materialize meta tensors, run ``init_weights``, then Lightning's setup."""
        module = self.lightning_module
        model: nn.Module = module.model
        if not is_fsdp_applied(model):
            self.parallelize(model)
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            self.materialize(model, seed=getattr(module, "init_seed", 0))
        super().setup(trainer)

    def parallelize(self, model: nn.Module) -> None:
        """The chain in its fixed order: TP -> EP -> FP8 -> activation checkpointing -> compile -> FSDP2."""
        assert self.parallel_mesh is not None
        # FSDP2 last: per block, then the root (tied embedding and head share the root unit).
        apply_fsdp(
            model,
            self.parallel_mesh.fsdp,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            reshard_after_forward=self.reshard_after_forward,
        )

    def materialize(self, model: nn.Module, seed: int) -> None:
        """Allocate meta tensors on the device and run the model's own init (the only init)."""
        model.to_empty(device=self.root_device)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        with torch.no_grad():
            model.init_weights(seed=seed)

    # -- checkpoints ----------------------------------------------------------------------------

    @property
    def checkpoint_io(self) -> DCPCheckpointIO:
        """The DCP checkpoint layout (see :mod:`kempnerforge.checkpoint.dcp_io`); used for every save and load."""
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        if io is not None and not isinstance(io, DCPCheckpointIO):
            raise TypeError(f"KempnerStrategy needs a DCPCheckpointIO (or a subclass), got {type(io).__name__}.")
        if io is not None:
            self._checkpoint_io = io

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        """Every rank writes its shards and its own RNG / dataloader state; rank 0 writes metadata."""
        path = Path(self.broadcast(str(filepath)))
        assert self.parallel_mesh is not None
        dp = self.parallel_mesh.dp
        checkpoint["rank_state"] = split_rank_state(checkpoint, dp.get_local_rank(), dp.size())
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore model and optimizer shards in place (resharding), then return Lightning's metadata."""
        path = self.checkpoint_io.resolve(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.parallel_mesh is not None
        load_model_and_optimizers(
            self.model, self.optimizers, path, self.checkpoint_io, strict=self.lightning_module.strict_loading
        )
        meta = self.checkpoint_io.load_checkpoint(path)
        dp = self.parallel_mesh.dp
        merge_rank_state(meta, meta.pop("rank_state"), dp.get_local_rank(), dp.size())
        return meta

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 deletes a checkpoint directory (``ModelCheckpoint(save_top_k=...)`` rotation)."""
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)
