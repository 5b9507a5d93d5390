"""Start-up cost of ``kforge fit``: a 1-step run against a plain PyTorch script doing the same step.

What it measures
----------------
Two commands, each a fresh process, run as ``--pairs`` interleaved pairs (the order alternates within a pair, so
both see the same machine state on a shared machine):

  (a) kforge  ``kforge fit --config configs/debug.yaml --trainer.max_steps=1`` (the console script, unchanged).
  (b) plain   ``python benchmarks/startup.py --child plain``: :func:`plain_step`, about 20 lines of PyTorch that
              do the same step: the recipe's ``kempnerforge.model.Transformer`` (built on meta, materialized,
              ``init_weights``), one batch of ``micro_batch_size`` windows read from the same token shards
              (``MemmapTokenDataset``), forward, cross-entropy, backward, grad-norm clip, one ``AdamW`` step with
              the recipe's optimizer settings.

Both run in a scratch folder whose ``configs`` and ``data`` link to the repository's (the recipe's paths are
relative; its ``runs/`` and ``checkpoints/`` are removed before each run, so every kforge run starts fresh).
One warm-up run of each comes first and is not counted (it tokenizes the shards once, fills the page cache and
the CPU-peak cache of ``MFUMonitor``). Reported: the median wall seconds and CPU seconds (user + sys of the
process) of each command and the ratio of the medians (the headline is wall, as the issue asks; CPU is the
steadier figure when other jobs share the cores). The load average before each pair is recorded.

Then a breakdown of kforge's time, from ``--phase-runs`` extra runs of ``--child phases`` (``kforge.entry.main``
in a process whose Lightning / kempnerforge methods are wrapped with timers; the benchmark's instrumentation, not
the product's): imports (``import kempnerforge.cli``), parser build (``LightningCLI.setup_parser``), argument
parsing, class instantiation (model, data module, Trainer, logger, callbacks), before_fit (auto-resume,
preflight), process group + mesh, data (prepare_data + setup hooks), configure_model, strategy setup (transforms,
materialize, init, optimizer), dataloaders, the first step, teardown, and process exit. And one
``python -X importtime`` run of the same child: self time per top-level package and, for the heavy optional
ones (torchmetrics, scipy, transformers, matplotlib, torch._dynamo, sympy), their cumulative time and which
module imported them first.

How to run
----------
    python benchmarks/startup.py                          # 5 pairs, 2 phase runs: 16 fresh processes
    python benchmarks/startup.py --pairs 9 --json /tmp/startup.json
    python benchmarks/startup.py --pairs 0 --phase-runs 1  # only the breakdown
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = "configs/debug.yaml"
KFORGE_ARGS = ["fit", "--config", RECIPE, "--trainer.max_steps=1"]
#: Packages whose cumulative import time and first importer are reported (start-up suspects of issue 21).
#: (``torchmetrics`` itself has no row of its own: Lightning imports it with ``importlib`` inside a version check.)
WATCHED = ("torchmetrics.functional", "scipy.signal", "matplotlib.pyplot", "transformers", "torch._dynamo", "sympy")


def plain_step(recipe: str = RECIPE) -> float:
    """The reference: one training step of the recipe's model on its data in plain PyTorch; returns the loss."""
    import torch
    import yaml

    from kempnerforge.config import ModelConfig
    from kempnerforge.data.memmap import MemmapTokenDataset
    from kempnerforge.model.transformer import Transformer

    cfg = yaml.safe_load(Path(recipe).read_text())
    model_cfg, data, opt = cfg["model"]["config"], cfg["data"], cfg["model"]["optimizer"]
    torch.manual_seed(cfg.get("seed_everything", 0))
    with torch.device("meta"):
        model = Transformer(ModelConfig(**model_cfg))
    model.to_empty(device="cpu")
    model.init_weights()
    dataset = MemmapTokenDataset(data["data_dir"], data["seq_len"], vocab_size=model_cfg["vocab_size"])
    rows = [dataset[i] for i in range(data["micro_batch_size"])]
    batch, labels = (torch.stack([r[key] for r in rows]) for key in ("input_ids", "labels"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], weight_decay=opt["weight_decay"])
    logits = model(batch)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["model"].get("grad_clip", 1.0))
    optimizer.step()
    optimizer.zero_grad()
    print(f"plain step: loss {loss.item():.4f}")
    return loss.item()


# --- kforge's phases (benchmark instrumentation) -------------------------------------------------------------


class _Timers:
    """Wall seconds spent in wrapped callables, by label (re-entrant calls count once)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.first_end: dict[str, float] = {}
        self._depth: dict[str, int] = {}

    def wrap(self, owner: object, name: str, label: str) -> None:
        orig = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            depth = timers._depth.get(label, 0)
            timers._depth[label] = depth + 1
            start = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                timers._depth[label] = depth
                if depth == 0:
                    now = time.perf_counter()
                    timers.total[label] = timers.total.get(label, 0.0) + now - start
                    timers.first_end.setdefault(label, now)

        setattr(owner, name, timed)


def _first_only(owner: object, name: str, timers: _Timers, label: str) -> None:
    """Time only the first call of ``owner.name`` (the first training step)."""
    orig = getattr(owner, name)

    def first(self, *args, **kwargs):
        if label in timers.total:
            return orig(self, *args, **kwargs)
        start = time.perf_counter()
        try:
            return orig(self, *args, **kwargs)
        finally:
            timers.total[label] = time.perf_counter() - start
            timers.first_end[label] = time.perf_counter()

    setattr(owner, name, first)


def phases_child(out: str) -> None:
    """``kforge fit`` in this process, with timers around its stages; writes them to ``out`` (JSON)."""
    t_start, wall_start = time.perf_counter(), time.time()
    import kempnerforge.cli  # noqa: F401 - the imports phase

    t_imported = time.perf_counter()
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
    from lightning.pytorch.trainer.trainer import Trainer

    from kempnerforge.cli import KForgeCLI
    from kempnerforge.entry import main
    from kempnerforge.strategies import KempnerStrategy

    timers = _Timers()
    timers.wrap(LightningCLI, "setup_parser", "parser build")
    timers.wrap(LightningCLI, "parse_arguments", "argument parsing")
    timers.wrap(KForgeCLI, "before_instantiate_classes", "instantiate")
    timers.wrap(LightningCLI, "instantiate_classes", "instantiate")
    timers.wrap(KForgeCLI, "before_fit", "before_fit (auto-resume, preflight)")
    timers.wrap(KempnerStrategy, "setup_environment", "process group + mesh")
    timers.wrap(_DataConnector, "prepare_data", "data module (prepare_data, setup)")
    timers.wrap(call, "_call_setup_hook", "data module (prepare_data, setup)")
    timers.wrap(call, "_call_configure_model", "configure_model")
    timers.wrap(KempnerStrategy, "setup", "strategy setup (transforms, init, optimizer)")
    timers.wrap(_FitLoop, "setup_data", "dataloaders")
    _first_only(_TrainingEpochLoop, "advance", timers, "first step")
    timers.wrap(Trainer, "_run", "Trainer._run")
    timers.wrap(Trainer, "_fit_impl", "Trainer.fit")  # not `fit`: the parser reads its signature
    main(KFORGE_ARGS)
    t_end = time.perf_counter()
    phases = {"imports": t_imported - t_start, **timers.total}
    run, fit = phases.pop("Trainer._run", 0.0), phases.pop("Trainer.fit", 0.0)
    named = ("process group + mesh", "data module (prepare_data, setup)", "configure_model")
    named += ("strategy setup (transforms, init, optimizer)", "dataloaders", "first step")
    step_end = timers.first_end.get("first step", t_end)
    phases["teardown (after the step, in Trainer.fit)"] = max(
        0.0, timers.first_end.get("Trainer.fit", t_end) - step_end
    )
    phases["other fit setup (hooks, restore, loggers)"] = max(
        0.0, fit - sum(phases.get(k, 0.0) for k in named) - phases["teardown (after the step, in Trainer.fit)"]
    )
    phases["rest of the CLI"] = max(0.0, (t_end - t_imported) - sum(v for k, v in phases.items() if k != "imports"))
    Path(out).write_text(json.dumps({"phases": phases, "wall_start": wall_start, "wall_end": time.time(), "run": run}))
    if "triton" not in sys.modules:
        gc.freeze()  # the exit the console script takes (kempnerforge.entry.console_main)


# --- the parent ----------------------------------------------------------------------------------------------


def _scratch() -> Path:
    """A folder where the recipe's relative paths resolve (``configs``, ``data`` link to the repository)."""
    root = Path(tempfile.mkdtemp(prefix="kforge-startup-"))
    for name in ("configs", "data"):
        (root / name).symlink_to(REPO / name)
    return root


def _clean(root: Path) -> None:
    for name in ("runs", "checkpoints", "lightning_logs"):
        shutil.rmtree(root / name, ignore_errors=True)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], stderr_path: Path | None = None) -> dict:
    """Run ``cmd``; wall and CPU seconds (user + sys, from ``wait4``) of the process."""
    _clean(cwd)
    start = time.perf_counter()
    stderr_path = stderr_path or cwd / "stderr.txt"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = "".join(stderr_path.read_text().splitlines(keepends=True)[-15:])
        raise SystemExit(f"{tail}\n{' '.join(cmd)} exited with {code} (in {cwd})")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "start": time.time() - wall}


def _kforge_cmd() -> list[str]:
    script = shutil.which("kforge")
    return [script, *KFORGE_ARGS] if script else [sys.executable, "-m", "kempnerforge.entry", *KFORGE_ARGS]


def _plain_cmd() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", "plain"]


def _phases_cmd(out: Path, importtime: bool = False) -> list[str]:
    flags = ["-X", "importtime"] if importtime else []
    return [sys.executable, *flags, str(Path(__file__).resolve()), "--child", "phases", "--out", str(out)]


def parse_importtime(text: str) -> dict:
    """Self seconds per top-level package, and for :data:`WATCHED`: cumulative seconds and first importer."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m.group(1)) / 1e6, int(m.group(2)) / 1e6, len(m.group(3)), m.group(4)))
    by_package: dict[str, float] = {}
    for self_s, _, _, name in rows:
        top = name.split(".")[0]
        by_package[top] = by_package.get(top, 0.0) + self_s
    watched = {}
    for i, (_, cum, level, name) in enumerate(rows):
        if name in WATCHED and name not in watched:  # importtime is post-order: the parent is the next shallower row
            chain = []  # the modules above it, innermost first
            for r in rows[i + 1 :]:
                if r[2] < level:
                    chain.append(r[3])
                    level = r[2]
            # The importer, and the first kempnerforge module on the way up (who asked for it).
            ours = [m for m in chain if m.startswith("kempnerforge")][:1]
            watched[name] = {"cumulative_s": cum, "imported_by": chain[:3] + [m for m in ours if m not in chain[:3]]}
    top = dict(sorted(by_package.items(), key=lambda kv: -kv[1])[:15])
    return {"total_self_s": sum(r[0] for r in rows), "self_s_by_package": top, "watched": watched}


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    """Parse the options, run the pairs and the breakdown, print and optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5, help="interleaved (plain, kforge) pairs")
    ap.add_argument("--phase-runs", type=int, default=2, help="instrumented kforge runs for the phase breakdown")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both commands")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", choices=["plain", "phases"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "plain":
        plain_step()
        return
    if args.child == "phases":
        phases_child(args.out)
        return

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    root = _scratch()
    result: dict = {"command": " ".join(["kforge", *KFORGE_ARGS]), "plain": " ".join(_plain_cmd()[1:]), "pairs": []}
    result["machine"] = {"cpus": os.cpu_count(), "threads": args.threads, "loadavg_start": os.getloadavg()}
    print(f"scratch folder {root}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    try:
        if args.pairs:  # only the timed pairs need a warm machine (the instrumented runs tokenize if need be)
            print("warm-up (not counted): kforge (tokenizes the shards once), plain", flush=True)
            _run(_kforge_cmd(), root, env)
            _run(_plain_cmd(), root, env)
        for i in range(args.pairs):
            load = os.getloadavg()[0]
            order = ("plain", "kforge") if i % 2 == 0 else ("kforge", "plain")
            pair = {"load": load}
            for name in order:
                pair[name] = _run(_plain_cmd() if name == "plain" else _kforge_cmd(), root, env)
            result["pairs"].append(pair)
            p, k = pair["plain"], pair["kforge"]
            print(
                f"pair {i + 1}/{args.pairs} (load {load:.2f}): plain {p['wall_s']:.2f} s wall / {p['cpu_s']:.2f} s CPU,"
                f" kforge {k['wall_s']:.2f} s / {k['cpu_s']:.2f} s -> {k['wall_s'] / p['wall_s']:.2f}x wall",
                flush=True,
            )
        if args.pairs:
            summary = {}
            for key in ("wall_s", "cpu_s"):
                plain = _median([p["plain"] for p in result["pairs"]], key)
                kforge = _median([p["kforge"] for p in result["pairs"]], key)
                paired = statistics.median(p["kforge"][key] / p["plain"][key] for p in result["pairs"])
                summary[key] = {"plain": plain, "kforge": kforge, "ratio": kforge / plain, "paired_ratio": paired}
            result["summary"] = summary
        result["phases"] = _phases(root, env, args.phase_runs)
        result["imports"] = _importtime(root, env)
        result["machine"]["loadavg_end"] = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


def _phases(root: Path, env: dict[str, str], runs: int) -> dict:
    collected: list[dict] = []
    for i in range(runs):
        out = root / f"phases{i}.json"
        outer = _run(_phases_cmd(out), root, env)
        data = json.loads(out.read_text())
        phases = data["phases"]
        # Interpreter start before the child's first line, and exit after main() returned (atexit, thread joins).
        phases["interpreter start + exit"] = max(0.0, outer["wall_s"] - (data["wall_end"] - data["wall_start"]))
        phases["total (wall)"] = outer["wall_s"]
        collected.append(phases)
        print(f"phase run {i + 1}/{runs}: {outer['wall_s']:.2f} s wall", flush=True)
    if not collected:
        return {}
    return {k: statistics.median(p.get(k, 0.0) for p in collected) for k in collected[0]}


def _importtime(root: Path, env: dict[str, str]) -> dict:
    out, err = root / "importtime.json", root / "importtime.txt"
    _run(_phases_cmd(out, importtime=True), root, env, stderr_path=err)
    return parse_importtime(err.read_text())


def _report(result: dict) -> None:
    print(f"\n{result['command']}  vs  python {result['plain']}   (CPUs {result['machine']['cpus']}, "
          f"threads {result['machine']['threads']}, load {result['machine']['loadavg_start'][0]:.2f} -> "
          f"{result['machine'].get('loadavg_end', [0])[0]:.2f})")  # fmt: skip
    if "summary" in result:
        n = len(result["pairs"])
        for key, label in (("wall_s", "wall"), ("cpu_s", "CPU")):
            s = result["summary"][key]
            print(f"  {label:4s} median of {n}: plain {s['plain']:.2f} s, kforge {s['kforge']:.2f} s, "
                  f"ratio {s['ratio']:.2f}x (median of paired ratios {s['paired_ratio']:.2f}x)")  # fmt: skip
    if result["phases"]:
        total = result["phases"]["total (wall)"]
        print("\nkforge phases (median wall seconds of the instrumented runs):")
        for name, sec in result["phases"].items():
            print(f"  {name:48s} {sec:6.2f} s  {100 * sec / total:5.1f}%")
    imports = result["imports"]
    print(f"\nimports (python -X importtime of the same run, {imports['total_self_s']:.2f} s):")
    print("  self time by package: " + ", ".join(f"{k} {v:.2f}" for k, v in imports["self_s_by_package"].items()))
    for name, info in imports["watched"].items():
        print(f"  {name:14s} {info['cumulative_s']:5.2f} s cumulative, imported by {' <- '.join(info['imported_by'])}")
    absent = [w for w in WATCHED if w not in imports["watched"]]
    if absent:
        print(f"  not imported: {', '.join(absent)}")


if __name__ == "__main__":
    main()
