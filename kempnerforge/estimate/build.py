"""Build what ``kforge fit`` builds, for one simulated rank: Trainer, LightningModule, DataModule, then the
strategy's mesh, the meta model, the parallel transform chain and (on fake tensors) its materialization
and the optimizer.

Nothing here allocates parameter memory: the model is built on the meta device, transformed there (TP ->
EP -> FP8 -> AC -> FSDP2, and the pipeline split for ``pp > 1``, by the strategy's own ``parallelize``),
and materialized under ``FakeTensorMode`` (shapes, dtypes and devices only). ``init_weights`` is not run:
the values would be fake, and a VLM encoder's pretrained weights are never read.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from kempnerforge.estimate.cluster import SimulatedEnvironment


@dataclass
class RankBuild:
    """The components of one simulated rank.

    Attributes:
        trainer, module, datamodule, strategy: as ``kforge fit`` instantiates them.
        model: the module's model (after :func:`parallelize`: this rank's part of it).
        roots: the FSDP2 roots (the model, or a pipeline rank's stage modules).
        optimizer: built by the module's ``configure_optimizers`` (after :func:`materialize_fake`).
        model_params: parameters of the whole model (all pipeline stages; a tied matrix once).
        notes: what the simulation changed from a real run (e.g. compile skipped).
    """

    trainer: Any
    module: Any
    datamodule: Any
    strategy: Any
    model: nn.Module | None = None
    roots: list[nn.Module] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    model_params: int = 0
    notes: list[str] = field(default_factory=list)


def parse(fit_args: list[str]) -> tuple[Any, Any, Any]:
    """Trainer, LightningModule and DataModule of ``kforge fit *fit_args`` (parsed and instantiated, not run).

    Raises:
        SystemExit: code 2 with ``kforge: error: ...`` for a bad argument or field (as ``kforge fit``).
    """
    from kempnerforge.cli import make_cli

    with warnings.catch_warnings():
        # The estimate passes its own argument list (the fit arguments plus the simulated cluster's size).
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
        cli = make_cli(fit_args, run=False)
    return cli.trainer, cli.model, cli.datamodule


def open_rank(fit_args: list[str], num_nodes: int, devices: int, rank: int) -> RankBuild:
    """Parse the config and set this rank's strategy up inside the (already initialized) fake world.

    Runs the strategy's ``setup_environment`` (degrees against the world size and the model, the data's
    sequence length, the pipeline options, then the mesh) and the module's ``setup("fit")`` (data lengths
    against ``max_seq_len``), exactly the checks ``kforge fit`` runs before it builds the model.

    Raises:
        ValueError: (``MeshConfigError`` and the components' own errors) a configuration that cannot run.
        TypeError: the trainer's strategy is not ``KempnerStrategy``.
    """
    from kempnerforge.strategies import KempnerStrategy

    trainer, module, datamodule = parse(fit_args)
    strategy = trainer.strategy
    if not isinstance(strategy, KempnerStrategy):
        raise TypeError(
            f"trainer.strategy is {type(strategy).__name__}; kforge estimate simulates "
            "kempnerforge.strategies.KempnerStrategy only."
        )
    strategy.cluster_environment = SimulatedEnvironment(num_nodes, devices, rank)
    strategy.cpu_keep_freed_memory = False  # a CPU-run knob; the simulated ranks are GPUs
    strategy.target_device_type = "cuda"  # device-dependent settings as the GPUs resolve them (auto precision)
    # With fault tolerance the simulated world is one replica group: its ranks hold what a run of that mesh holds, and
    # nothing connects to a lighthouse (the groups' all-reduce of gradient shards is not simulated).
    strategy.fault_tolerance = None
    check_simulable(module)
    strategy._lightning_module = module
    module.trainer = trainer
    trainer._data_connector.attach_datamodule(module, datamodule)  # as Trainer.fit: the strategy's checks read it
    strategy.setup_environment()
    module.setup("fit")
    return RankBuild(trainer, module, datamodule, strategy, notes=substitutions(strategy, datamodule))


def check_simulable(module: Any) -> None:
    """Refuse, in one line, settings the fake-tensor step cannot run.

    Raises:
        ValueError: ``model.loss_impl=liger`` (Liger-Kernel's Triton kernels have no fake-tensor implementation).
    """
    if getattr(module, "loss_impl", None) == "liger":
        raise ValueError(
            "model.loss_impl: liger runs Triton kernels the fake-tensor simulation cannot run; estimate with "
            "model.loss_impl=chunked, the fused head + loss it simulates (no (tokens, vocab) block either)"
        )


def substitutions(strategy: Any, datamodule: Any) -> list[str]:
    """What the simulation resolves as the target GPUs would, or runs differently, one line each (the report's
    notes): ``auto`` precision on CUDA; packed documents' attention mask."""
    notes = []
    if strategy.mixed_precision_param == "auto" and strategy.true_half is None:
        notes.append(
            "mixed_precision_param=auto resolved as on CUDA: "
            f"{strategy.describe_precision().removeprefix('precision: ').split(', fp32 matmuls')[0]}."
        )
    if getattr(datamodule, "document_masking", False):
        notes.append(
            "packed documents: CUDA runs FlexAttention with a block mask; the simulated CPU ranks build the dense "
            "(batch, 1, seq, seq) bool mask instead, which this estimate counts (batch * seq^2 bytes per micro-batch)."
        )
    return notes


def touch_meshes(mesh: Any) -> None:
    """Create every sub-mesh of ``mesh`` (a :class:`~kempnerforge.parallel.mesh.ParallelMesh`: flattened ``dp``,
    expert meshes) now: DeviceMesh slicing cannot run under ``FakeTensorMode`` (as in torchtitan's estimator)."""
    _ = mesh.dp, mesh.dp_cp, mesh.cp, mesh.fsdp, mesh.tp, mesh.pp
    if mesh.dims.ep > 1:
        _ = mesh.ep, mesh.expert_fsdp


def parallelize(build: RankBuild) -> None:
    """Build the model on meta (the module's ``configure_model``) and apply the strategy's chain to it.

    ``compile`` is switched off first (compiling fake-tensor graphs says nothing about memory); noted in
    ``build.notes``.
    """
    strategy, module = build.strategy, build.module
    with strategy.tensor_init_context(empty_init=True):
        module.configure_model()
    build.model = module.model
    build.model_params = sum(p.numel() for p in build.model.parameters())
    if strategy.compile:
        strategy.compile = False
        build.notes.append("compile=true is skipped in the simulation (eager memory and FLOPs are reported).")
    touch_meshes(strategy.parallel_mesh)
    strategy.parallelize(build.model)
    pipeline = strategy.pipeline
    build.roots = list(pipeline.stage_modules) if pipeline is not None else [build.model]


def materialize_fake(build: RankBuild) -> None:
    """Allocate every meta parameter and buffer as a fake tensor on the strategy's device (call inside
    ``FakeTensorMode``), then tie weights and build the optimizer through the module's ``configure_optimizers``.

    FSDP2 roots are materialized by their own ``to_empty`` (FSDP2 re-registers its sharded parameters there);
    what remains on meta (unsharded modules, RoPE buffers) is replaced in place, as the pipeline runner does.
    """
    device = build.strategy.root_device
    for root in build.roots:
        if isinstance(root, FSDPModule):
            root.to_empty(device=device)
    for module in build.model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is not None and t.is_meta:
                    new = torch.empty_like(t, device=device)
                    store[name] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    if hasattr(build.model, "tie_weights"):
        build.model.tie_weights()
    build.optimizer = build.module.configure_optimizers()["optimizer"]
    build.strategy.optimizers = [build.optimizer]


def warm_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state as its first step does (zero gradients, one ``step``), so the measured
    step is a steady-state one with every state tensor alive, without a second simulated forward/backward."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
