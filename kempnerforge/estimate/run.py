"""``estimate``: the recipe's real chain and one training step on a simulated ``num_nodes x devices`` cluster.

For each distinct role (one rank per pipeline stage position; with ``pp = 1`` every rank is alike and rank 0
stands for all), in a fresh fake world: parse the recipe as ``kforge fit`` does, run the strategy's checks
and mesh, build the model on meta, apply the chain, materialize on fake tensors, build the optimizer and run
one step (:func:`~kempnerforge.estimate.step.run_step`). The fake process group is destroyed after each role.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule

from kempnerforge.cli import uses_class_paths
from kempnerforge.estimate.allowance import GPU_KINDS, Allowance
from kempnerforge.estimate.build import RankBuild, materialize_fake, open_rank, parallelize, warm_optimizer
from kempnerforge.estimate.cluster import fake_world
from kempnerforge.estimate.fake_ops import FakeTensorLimitError
from kempnerforge.estimate.report import Estimate, RoleEstimate, gb, role_estimate
from kempnerforge.estimate.step import run_step


class EstimateConfigError(ValueError):
    """A configuration ``kforge fit`` would refuse (a degree that does not fit the world, a model / data /
    parallelism rule): raised before any model is built, with the component's own message."""


def _quiet(message: str) -> None:
    pass


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """Silence the fake-tensor logger's tracebacks for kernels probed on fake tensors (e.g. the MoE grouped-GEMM
    probe, whose refusal is an answer, not an error); a failure that matters still raises."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def simulation_args(fit_args: list[str], num_nodes: int, devices: int) -> list[str]:
    """``fit_args`` plus the simulated cluster's size, on CPU (fake tensors stand in for the GPUs' memory)."""
    return [*fit_args, "--trainer.accelerator=cpu", f"--trainer.devices={devices}", f"--trainer.num_nodes={num_nodes}"]


def chain_summary(build: RankBuild) -> str:
    """What the chain applied on this rank, in its order (e.g. ``"TP=8 + sequence parallel -> AC selective_op ->
    FSDP2 over dp_shard=8"``)."""
    strategy, dims = build.strategy, build.strategy.parallel_mesh.dims
    parts = []
    if dims.pp > 1:
        parts.append(f"pipeline split pp={dims.pp} ({strategy.pipeline.schedule_name}, stages {strategy.pipeline.ids})")
    if dims.tp > 1:
        parts.append(f"TP={dims.tp}" + (" + sequence parallel" if strategy.sequence_parallel else ""))
    if dims.ep > 1:
        parts.append(f"EP={dims.ep}")
    if strategy.float8_recipe is not None:
        parts.append(f"FP8 {strategy.float8_recipe}")
    if strategy.activation_checkpointing != "none":
        parts.append(f"AC {strategy.activation_checkpointing}")
    if all(isinstance(r, FSDPModule) for r in build.roots):
        # cp ranks hold shards of their own: FSDP2 shards over dp_shard x cp, and ep borrows from that axis.
        axis, lent = ("dp_shard", dims.dp_shard) if dims.cp == 1 else ("dp_shard_cp", dims.dp_shard * dims.cp)
        replicas = f"dp_replicate={dims.dp_replicate} x " if dims.dp_replicate > 1 else ""
        experts = ""
        if dims.ep > 1:  # experts: FSDP2 over the lent ranks that are not ep, replicated over dp_replicate
            experts = f" (experts over {replicas}{axis}/ep={lent // dims.ep})"
        parts.append(f"FSDP2 over {replicas}{axis}={lent}{experts}")
    else:
        parts.append("no FSDP2 (one shard in fp32: nothing to shard or cast)")
    return " -> ".join(parts)


def roles(build: RankBuild) -> list[int]:
    """Global ranks standing for the distinct roles: rank ``p * world / pp`` for every pipeline position ``p``
    (``pp`` is the outermost mesh axis); ``[0]`` without pipelining."""
    dims = build.strategy.parallel_mesh.dims
    return [p * (dims.world_size // dims.pp) for p in range(dims.pp)]


def simulate_rank(
    fit_args: list[str],
    num_nodes: int,
    devices: int,
    rank: int,
    progress: Callable[[str], None] = _quiet,
    announce: str | None = None,
) -> tuple[RankBuild, RoleEstimate]:
    """Build and step one simulated rank in its own fake world (torn down on return or error); ``announce``, if
    given, is the first line sent to ``progress``, once the configuration passed the checks."""
    world = num_nodes * devices
    with fake_world(world, rank):
        try:
            build = open_rank(simulation_args(fit_args, num_nodes, devices), num_nodes, devices, rank)
        except (ValueError, TypeError) as err:
            raise EstimateConfigError(str(err)) from err
        if announce is not None:
            progress(announce)
        mesh = build.strategy.parallel_mesh
        coords = ", ".join(
            f"{k}={v}" for k, v in mesh.coordinates().items() if mesh.dims.shape[list(mesh.coordinates()).index(k)] > 1
        )
        progress(f"rank {rank} of {world} (coordinates {coords or 'none'}): building the model on meta")
        start = time.perf_counter()
        parallelize(build)
        progress(f"rank {rank}: parallelized: {chain_summary(build)}")
        with FakeTensorMode(allow_non_fake_inputs=True), _quiet_fake_tensor_log():
            materialize_fake(build)
            warm_optimizer(build.optimizer)
            progress(f"rank {rank}: one training step (forward, backward, optimizer) on fake tensors")
            result = run_step(build, lambda message: progress(f"rank {rank}: {message}"))
        seconds = time.perf_counter() - start
        progress(f"rank {rank}: step simulated in {result.seconds:.1f} s ({seconds:.1f} s with the build)")
        return build, role_estimate(build, rank, result)


def simulate_roles(
    fit_args: list[str],
    num_nodes: int,
    devices: int,
    progress: Callable[[str], None] = _quiet,
    announce: str | None = None,
) -> tuple[RankBuild, list[RoleEstimate]]:
    """Every distinct role of ``kforge fit *fit_args`` on ``num_nodes x devices`` ranks: rank 0's build and the
    roles' estimates (rank 0 first).

    Raises:
        EstimateConfigError: as :func:`simulate_rank`.
    """
    build, first = simulate_rank(fit_args, num_nodes, devices, 0, progress, announce)
    results = [first]
    for rank in roles(build)[1:]:
        results.append(simulate_rank(fit_args, num_nodes, devices, rank, progress)[1])
    return build, results


def estimate(
    fit_args: list[str],
    num_nodes: int,
    devices: int,
    gpu_memory_gb: float | None = None,
    progress: Callable[[str], None] = _quiet,
    alternatives: bool = True,
    allowance: Allowance | None = None,
    knobs: Collection[str] | None = None,
) -> Estimate:
    """Estimate every distinct role of ``kforge fit *fit_args`` on ``num_nodes x devices`` GPUs.

    Args:
        fit_args: a ``kforge fit`` command line without the subcommand (``--config ...`` and overrides);
            ``trainer.accelerator / devices / num_nodes`` are set by the estimate.
        num_nodes, devices: the simulated cluster.
        gpu_memory_gb: memory of one GPU (GB = 1e9 bytes) for the verdict; None: the GPU kind's
            (:data:`~kempnerforge.estimate.allowance.GPU_KINDS`, 80 for the default H100).
        progress: receives one line per phase, the first once the configuration passed ``kforge fit``'s checks
            (nothing before: a refused configuration gets no progress line).
        alternatives: when it does not fit, estimate the changes that could make it fit (one simulated step per
            role and size tried, :mod:`~kempnerforge.estimate.verdict`); False: no suggestions.
        allowance: the allowance model (GPU kind and terms); None: an H100's defaults.
        knobs: the knobs suggestions may change (:data:`~kempnerforge.estimate.verdict.KNOBS`); None: all.

    Raises:
        EstimateConfigError: a configuration ``kforge fit`` would refuse (names the field), before any model is built.
        SystemExit: a parse error (unknown field), as ``kforge fit`` exits.
    """
    from kempnerforge.estimate.verdict import KNOBS, Candidate, verdict

    allowance = allowance or Allowance.for_gpu()
    if gpu_memory_gb is None:
        gpu_memory_gb = GPU_KINDS[allowance.gpu].memory_gb
    start = time.perf_counter()
    # Announced once the checks passed, so a refused configuration prints its error line and nothing else.
    announce = f"simulating {num_nodes} x {devices} = {num_nodes * devices} ranks"
    est, build = _estimate_of(fit_args, num_nodes, devices, gpu_memory_gb, allowance, progress, announce)

    def rerun(candidate: Candidate) -> Estimate | None:
        change = candidate.change(est)
        progress(f"suggestion {candidate.knob}: estimating {change}")
        args = [*fit_args, *candidate.overrides]
        try:
            changed = _estimate_of(args, candidate.num_nodes, candidate.devices, gpu_memory_gb, allowance)[0]
        except EstimateConfigError as err:
            progress(f"suggestion {candidate.knob}: {change} dropped: kforge fit refuses it ({err})")
            return None
        except FakeTensorLimitError as err:
            progress(f"suggestion {candidate.knob}: {change} dropped: {err}")
            return None
        peak = max(r.peak_bytes for r in changed.roles)
        progress(f"suggestion {candidate.knob}: {change} -> peak {gb(peak)} per rank")
        return changed

    subclass = uses_class_paths(fit_args)
    est.verdict = verdict(
        est,
        allowance,
        build.module,
        build.strategy,
        build.datamodule,
        subclass,
        rerun if alternatives else None,
        knobs=KNOBS if knobs is None else knobs,
    )
    est.seconds = time.perf_counter() - start
    return est


def _estimate_of(
    fit_args: list[str],
    num_nodes: int,
    devices: int,
    gpu_memory_gb: float,
    allowance: Allowance,
    progress: Callable[[str], None] = _quiet,
    announce: str | None = None,
) -> tuple[Estimate, RankBuild]:
    """The :class:`Estimate` of every role, without a verdict, and rank 0's build."""
    build, results = simulate_roles(fit_args, num_nodes, devices, progress, announce)
    dims = build.strategy.parallel_mesh.dims
    return Estimate(
        num_nodes=num_nodes,
        devices_per_node=devices,
        gpu_memory_bytes=int(gpu_memory_gb * 1e9),
        degrees=dict(zip(("pp", "dp_replicate", "dp_shard", "cp", "tp"), dims.shape, strict=True)) | {"ep": dims.ep},
        model_params=build.model_params,
        roles=results,
        notes=list(build.notes),
        allowance=allowance.to_json(),
    ), build
