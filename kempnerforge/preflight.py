"""What ``kforge`` checks once the classes are built and before any process starts, waits or allocates.

Lightning initializes the process group after ``Trainer.fit`` launched the other local ranks, so a
setting that cannot work would otherwise be found once per rank, after the rendezvous (a job that waited
hours in the queue then fails, or never starts because a rank is missing). Everything here needs only the
configs, the files and the world size the cluster environment already knows (:func:`expected_world`):

- paths: the data (``data.data_dir`` prepared, or ``data.source``), ``data.tokenizer``, the vision encoder's
  ``pretrained_path``, an explicit ``ckpt_path`` (and, on global rank 0, the files rank 0 reads:
  :func:`~kempnerforge.checkpoint.verify.verify_rank_files`);
- the data's records, where the data module has a ``check_source`` (chat jsonl: every line, on global rank 0);
- ``model.init_from``'s safetensors headers against the model's parameters (global rank 0:
  :func:`~kempnerforge.checkpoint.init_from.check_hf_weights`);
- the mesh: degrees against the world size, the model's and the data's parallel rules
  (:meth:`KempnerStrategy.check_layout`), the data's lengths against the model (``check_data``), and the data
  against the trainer and the data-parallel degree where the data module has a ``check_run`` (a stream: ``max_steps``,
  ``val_check_interval``, its first rows on global rank 0);
- ``model.loss_impl=liger`` on a CUDA accelerator with liger-kernel installed (:func:`check_loss_impl`);
- the checkpoint folder (``fit``, global rank 0): writable, with room for one checkpoint of the estimated
  size (:func:`checkpoint_bytes`); the loggers' folders and the ``data_dir`` a ``data.source`` is prepared into:
  writable (:mod:`kempnerforge.data.input_checks`, nothing created).

Each failure raises a :class:`~kempnerforge.errors.UserError` (or the library's typed error), which the CLI
prints as one line. :func:`warn_bf16_on_cpu` only warns.
"""

from __future__ import annotations

import glob
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kempnerforge.checkpoint.disk import ensure_writable, existing_parent, format_bytes, free_bytes
from kempnerforge.data.input_checks import check_source, check_tokenizer, check_writable
from kempnerforge.errors import PathError, UserError
from kempnerforge.resilience.ft_config import check_accumulation_ft
from kempnerforge.resilience.rendezvous import WorldSpec, expected_world

#: fp32 optimizer-state tensors per trained parameter (AdamW: exp_avg + exp_avg_sq; Lion: momentum; Muon: AdamW's
#: two on the parameters it does not orthogonalize; Schedule-Free AdamW: z + exp_avg_sq).
OPTIMIZER_STATES = {"adamw": 2, "lion": 1, "muon": 2, "schedule_free_adamw": 2}
#: Bytes per stored parameter value: DCP holds the fp32 (master) shards.
BYTES_PER_VALUE = 4


def _local_path(value: Any) -> bool:
    """True for a string that names a local path or glob pattern that matches something."""
    return bool(glob.glob(str(Path(value).expanduser())))


def check_paths(module: Any, datamodule: Any) -> None:
    """Every local path the module and the data module will read exists (no file is opened).

    Raises:
        PathError: ``data.tokenizer``, ``data.source``, ``data.data_dir`` (not prepared and no source),
            ``data.sources[i].data_dir`` or ``model.encoder.pretrained_path`` that is not there; ``model.init_from``
            without safetensors weights.
        ValueError: a ``data.source`` spec that names anything but local files (``check_dataset_spec``).
    """
    init_from = getattr(module, "init_from", None)
    if init_from is not None:
        from kempnerforge.checkpoint.init_from import check_init_from

        check_init_from(init_from)
    encoder = getattr(module, "encoder_config", None)
    pretrained = getattr(encoder, "pretrained_path", None)
    if pretrained is not None and not (Path(pretrained) / "config.json").is_file():
        raise PathError(
            "model.encoder.pretrained_path",
            f"{pretrained} is not a transformers save_pretrained folder (no config.json there); nothing is downloaded",
        )
    dm = datamodule
    tokenizer = getattr(dm, "tokenizer_path", None)
    tokenizer = tokenizer if isinstance(tokenizer, str) else getattr(dm, "tokenizer", None)
    if init_from is not None and isinstance(tokenizer, str) and Path(tokenizer) == Path(init_from):
        from kempnerforge.checkpoint.init_from import check_tokenizer_files

        check_tokenizer_files(init_from)
    if isinstance(tokenizer, str) and not Path(tokenizer).expanduser().exists():
        raise PathError(
            "data.tokenizer",
            f"{tokenizer} does not exist; give a local tokenizer folder (e.g. data/tokenizers/gpt2): nothing is "
            "downloaded",
        )
    if isinstance(tokenizer, str):
        check_tokenizer(tokenizer, "data.tokenizer")  # a file that is no tokenizer.json, a folder without one
    source = getattr(dm, "source", None)
    data_dir = getattr(dm, "data_dir", None)
    if isinstance(source, dict):
        from kempnerforge.data.sources import check_dataset_spec

        check_dataset_spec(source)
    elif isinstance(source, str) and not _local_path(source):
        raise PathError("data.source", f"{source} does not exist (a local file, folder or glob pattern)")
    elif isinstance(source, str):
        check_source(source, "data.source")  # only empty files: nothing would be tokenized
    if source is not None and isinstance(data_dir, str) and not (Path(data_dir) / "metadata.json").is_file():
        check_writable(data_dir, "data.data_dir")  # the source is prepared into it at the start
    for i, src in enumerate(getattr(dm, "sources", None) or []):
        src_dir = getattr(src, "data_dir", None)
        if isinstance(src_dir, str) and not (Path(src_dir) / "metadata.json").is_file():
            raise PathError(f"data.sources[{i}].data_dir", f"{src_dir} holds no prepared shards (metadata.json)")
        if isinstance(src_dir, str):
            _check_metadata(f"data.sources[{i}].data_dir", src_dir, getattr(dm, "vocab_size", None))
    if source is None and isinstance(data_dir, str) and not getattr(dm, "sources", None):
        if not (Path(data_dir) / "metadata.json").is_file():
            raise PathError(
                "data.data_dir",
                f"{data_dir} holds no prepared token shards (metadata.json): run kforge prepare-data --output_dir "
                f"{data_dir}, or set data.source and data.tokenizer to prepare it at the start",
            )
        _check_metadata("data.data_dir", data_dir, getattr(dm, "vocab_size", None))


def _check_metadata(field: str, data_dir: str, vocab_size: Any = None) -> None:
    """``data_dir/metadata.json`` parses and lists shards (one small file; no shard is opened), and its tokenizer's
    vocabulary fits the model's (``vocab_size``, the data module's copy of it; None: not checked).

    Raises:
        PathError: naming ``field``, when the record is not valid JSON or lacks what the dataset reads.
        UserError: naming ``field``, when the data was tokenized with more ids than the model has.
    """
    from kempnerforge.data.memmap import TokenDataError, read_metadata, vocab_mismatch

    try:
        meta = read_metadata(data_dir)
    except TokenDataError as err:
        raise PathError(field, f"{err}; prepare it again (kforge prepare-data --output_dir {data_dir})") from err
    problem = vocab_mismatch(meta, vocab_size, data_dir)  # the dataset's own check, before any process starts
    if problem:
        raise UserError(field, f"{problem} (model.config.vocab_size), or prepare the data with the model's tokenizer")


def check_ckpt_path(strategy: Any, ckpt_path: Any, world: WorldSpec) -> None:
    """An explicit ``ckpt_path`` is a complete checkpoint; on global rank 0 the files rank 0 reads before DCP are whole
    too (``.metadata``, ``meta.pt``, ``rank_00000.pt``: O(1) files whatever the world size; the other ranks' files
    and the shards are checked by the ranks that read them, in the restore).

    Raises:
        CheckpointError / CorruptCheckpointError: names what is missing or the bad file.
        PathError: a plain Lightning checkpoint file that does not exist (other strategies).
    """
    from kempnerforge.resilience.auto_resume import AUTO
    from kempnerforge.strategies import KempnerStrategy

    if ckpt_path is None or str(ckpt_path) == AUTO or ckpt_path in ("last", "best", "hpc", "registry"):
        return
    if not isinstance(strategy, KempnerStrategy):
        if not Path(ckpt_path).exists():
            raise PathError("ckpt_path", f"{ckpt_path} does not exist")
        return
    if Path(ckpt_path).is_file():  # torch.load of it would fail with advice to unpickle anything (weights_only=False)
        raise PathError(
            "ckpt_path",
            f"{ckpt_path} is a file, not a checkpoint; give a checkpoint folder (step=N.ckpt), the folder holding "
            "`latest`, or auto",
        )
    resolved = strategy.checkpoint_io.resolve(ckpt_path)
    if world.rank == 0 and resolved.is_dir():
        from kempnerforge.checkpoint.verify import verify_rank_files

        verify_rank_files(resolved, 0)  # rank 0's own files: every other rank checks its own in the restore


def check_layout(trainer: Any, module: Any, datamodule: Any, world: WorldSpec) -> int:
    """The strategy's mesh rules at the world size the job will have, then the data against the model.

    The module is attached to the trainer first (``Trainer.fit`` does it again), so its ``validate_parallel``
    sees the strategy's options.

    Returns:
        The data-parallel degree (distinct data shards; the world size under another strategy).

    Raises:
        MeshConfigError / ValueError: the first rule that fails (a degree, naming where the world size comes from).
    """
    from kempnerforge.parallel.mesh import MeshConfigError
    from kempnerforge.strategies import KempnerStrategy

    strategy = trainer.strategy
    dp = world.size
    if isinstance(strategy, KempnerStrategy):
        module.trainer = trainer
        try:
            dp = strategy.check_layout(world.size, module, datamodule).dp
        except MeshConfigError as err:
            if "world_size" not in str(err):
                raise
            raise MeshConfigError(f"{err} (the world size {world.size} comes from {world.source})") from err
    check_data = getattr(module, "check_data", None)
    if callable(check_data):
        check_data(datamodule)
    return dp


def check_loss_impl(trainer: Any, module: Any) -> None:
    """``model.loss_impl=liger`` needs a CUDA accelerator and liger-kernel (refused here, before any rank starts).

    Raises:
        UserError: ``model.loss_impl`` is ``liger`` on another accelerator or without liger-kernel installed.
    """
    if getattr(module, "loss_impl", None) != "liger":
        return
    from lightning.pytorch.accelerators import CUDAAccelerator

    if not isinstance(trainer.accelerator, CUDAAccelerator):
        raise UserError(
            "model.loss_impl",
            "liger runs Liger-Kernel's Triton kernels on CUDA only; use auto, torch or chunked on this accelerator",
        )
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError("model.loss_impl", "liger needs liger-kernel: pip install 'kempnerforge[gpu]'")


def checkpoint_bytes(module: Any) -> int | None:
    """Estimated bytes of one checkpoint of ``module``: fp32 parameters plus their optimizer state (None when
    the module does not describe its size: not a ``CausalLM``).

    A decoder's parameters come from its config (:meth:`ModelConfig.num_params`); a VLM adds its encoder and
    connector, counted on the meta device (nothing allocated). Frozen parameters are counted with optimizer
    state too (the VLM optimizer holds every ever-trainable parameter), so this errs on the large side.
    """
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "num_params", None)):
        return None
    params = config.num_params()
    if getattr(module, "encoder_config", None) is not None:
        params += _vision_params(module)
    name = getattr(getattr(module, "optimizer_config", None), "name", "adamw")
    return params * BYTES_PER_VALUE * (1 + OPTIMIZER_STATES.get(name, 2))


def _vision_params(module: Any) -> int:
    import torch

    from kempnerforge.model.connectors import Connector
    from kempnerforge.model.vision import VisionEncoder

    with torch.device("meta"):
        encoder = VisionEncoder(module.encoder_config)
        connector = Connector(module.connector_config, encoder.width, module.config.dim, encoder.grid)
    return sum(p.numel() for m in (encoder, connector) for p in m.parameters())


def checkpoint_folders(trainer: Any) -> list[Path]:
    """The folders saves go to: the ``ModelCheckpoint``'s and a ``Preemption`` callback's ``dirpath``."""
    from kempnerforge.callbacks import Preemption

    folders = [getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks]
    folders += [cb.dirpath for cb in trainer.callbacks if isinstance(cb, Preemption)]
    return list(dict.fromkeys(Path(f) for f in folders if f is not None))


def check_checkpoint_folder(
    folder: Path, needed: Callable[[], int | None], field: str = "ModelCheckpoint.dirpath"
) -> None:
    """``folder`` can be created and written, and has room for ``needed()`` bytes (one checkpoint; None: unknown).

    Raises:
        UserError: not writable (the OS error), or fewer bytes free than needed (both numbers).
    """
    try:
        check_writable(folder, field)  # nothing created: a later refusal leaves no empty checkpoint folder behind
        if folder.is_dir():
            ensure_writable(folder)  # a real write (and removal) where access() can be wrong (NFS root squash, quota)
    except PathError as err:
        raise UserError(field, f"{err}; checkpoints go there") from err
    except OSError as err:
        raise UserError(field, f"{folder} is not writable ({err.strerror or err}); checkpoints go there") from err
    needed = needed()
    if needed is None:
        return
    free = free_bytes(folder)
    if free < needed:
        raise UserError(
            field,
            f"{existing_parent(folder)} has {format_bytes(free)} free, but one checkpoint of this model needs about "
            f"{format_bytes(needed)} (fp32 parameters + optimizer state); free space or save elsewhere",
        )


def check_log_folders(trainer: Any) -> None:
    """Every logger's folder (``save_dir``) can be written or created; nothing is created.

    Raises:
        PathError: naming ``trainer.logger.init_args.save_dir`` (``trainer.logger[i]`` for several loggers).
    """
    loggers = list(getattr(trainer, "loggers", None) or [])
    for i, logger in enumerate(loggers):
        folder = getattr(logger, "save_dir", None) or getattr(logger, "root_dir", None)
        if isinstance(folder, str | Path):
            field = (
                "trainer.logger.init_args.save_dir" if len(loggers) == 1 else f"trainer.logger[{i}].init_args.save_dir"
            )
            check_writable(folder, field)


def warn_bf16_on_cpu(trainer: Any, precision: str | None = None) -> None:
    """Warn (rank 0) when a CPU run is asked for bf16 compute: CPUs without bf16 matrix units run it several times
    slower than fp32, and the FSDP2 policy, not the trainer, sets the compute dtype here.

    Args:
        trainer: the instantiated Trainer.
        precision: ``trainer.precision`` as configured (None: the trainer's, which a strategy may have mapped
            onto its own policy already).
    """
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    if not isinstance(trainer.accelerator, CPUAccelerator):
        return
    precision = str(precision if precision is not None else getattr(trainer, "precision", ""))
    param = str(getattr(trainer.strategy, "param_dtype", ""))
    if precision.startswith("bf16"):
        asked = f"trainer.precision={precision}"
    elif param.endswith("bfloat16"):
        asked = "trainer.strategy.init_args.mixed_precision_param=bfloat16"
    else:
        return
    rank_zero_warn(
        f"{asked} on CPU: bf16 matmuls are slow on CPUs (most have no bf16 matrix units); use trainer.precision="
        "32-true and trainer.strategy.init_args.mixed_precision_param=float32 there (bf16 compute on GPUs comes "
        "from mixed_precision_param, the FSDP2 policy)."
    )


def preflight(
    trainer: Any, module: Any, datamodule: Any, ckpt_path: Any, subcommand: str, precision: str | None = None
) -> WorldSpec | None:
    """All of the above for one ``kforge`` command, in the order a user would fix them.

    Args:
        trainer, module, datamodule: as LightningCLI instantiated them.
        ckpt_path: the command's ``ckpt_path`` (``auto`` / an ``AutoResume``, a path, or None).
        subcommand: ``fit``, ``validate``, ``test`` or ``predict`` (the checkpoint folder is checked for ``fit``).
        precision: ``trainer.precision`` as configured (for :func:`warn_bf16_on_cpu`).

    Returns:
        The expected world (None for a strategy without a cluster environment).
    """
    check_paths(module, datamodule)
    check_log_folders(trainer)
    strategy = trainer.strategy
    world = expected_world(strategy) if getattr(strategy, "cluster_environment", None) is not None else None
    world = world or WorldSpec(1, 0, "trainer.devices", "one process", "")
    check_source = getattr(datamodule, "check_source", None)
    if callable(check_source) and world.rank == 0:  # reads the whole source once: one rank does it
        check_source()
    init_from = getattr(module, "init_from", None)
    if init_from is not None and world.rank == 0:  # every file header and tensor shape: one rank reads them
        from kempnerforge.checkpoint.init_from import check_hf_weights

        check_hf_weights(init_from, module.config)
    check_ckpt_path(strategy, ckpt_path, world)
    dp = check_layout(trainer, module, datamodule, world)
    check_run = getattr(datamodule, "check_run", None)
    if callable(check_run):  # the data against the trainer and the data-parallel degree (a streaming module)
        check_run(trainer, dp, world.rank)
    check_loss_impl(trainer, module)
    check_accumulation_ft(getattr(strategy, "fault_tolerance", None), trainer.accumulate_grad_batches)
    if subcommand == "fit" and world.rank == 0:
        for folder in checkpoint_folders(trainer):
            check_checkpoint_folder(folder, lambda: checkpoint_bytes(module))
    warn_bf16_on_cpu(trainer, precision)
    return world
