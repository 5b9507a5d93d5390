"""SIGTERM to the whole process group of a multi-process `kforge fit` of any CPU recipe, at random points, then the
identical command again until the run is done: every killed run must stop with the "stopped early" status (75)
within 30 s and the stitched losses must equal an uninterrupted run's (1e-6).

Used by ``tests/e2e/test_recipe_kills.py`` (every CPU recipe, tiny shapes) and by ``tests/e2e/kill_soak.py`` (many
kills, a script). Each recipe runs as written (its own callbacks: none of the CPU recipes names ``Preemption``, so
the strategy's default handling is what stops it) and with an explicit ``Preemption`` callback added.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.e2e.preempt_helpers import REPO, losses, start, wait_for

#: Recipes that train on this CPU machine (the others need GPUs or a real HF folder), and the processes each needs.
CPU_RECIPES = {
    "debug": 2, "moe_debug": 2, "pp_debug": 2, "cp_debug": 2, "finetune_debug": 2,
    "vlm_jd": 2, "vlm_cross_attn": 2, "vlm_mot": 2, "vlm_moma": 2, "vlm_video": 2,
}  # fmt: skip
TEXT_RECIPES = ("debug", "moe_debug", "pp_debug", "cp_debug", "finetune_debug")
#: Seconds any one run of a kill sequence may take (a tiny recipe runs in 10-60 s on 2 busy cores).
WAIT_S = float(os.environ.get("KFORGE_KILL_WAIT_S", "240"))


@dataclass
class KillResult:
    """What one recipe's kill sequence did: the exit codes in order (the last is the finishing run), seconds from
    each signal to the exit, the steps each killed run stopped at, and the largest loss difference to the
    uninterrupted run (inf when a step is missing)."""

    recipe: str
    codes: list[int] = field(default_factory=list)
    exit_s: list[float] = field(default_factory=list)
    stopped_at: list[int] = field(default_factory=list)
    max_loss_diff: float = float("inf")

    @property
    def ok(self) -> bool:
        """Every kill stopped with 75 within 30 s, the last run finished (0) and the losses match (1e-6)."""
        killed = self.codes[:-1]
        return (
            bool(killed)
            and all(c == 75 for c in killed)
            and self.codes[-1] == 0
            and max(self.exit_s) < 30
            and (self.max_loss_diff <= 1e-6)
        )


def _is(callback: dict, name: str) -> bool:
    return callback["class_path"].rsplit(".", 1)[-1] == name


def recipe_config(
    tmp: Path, recipe: str, steps: int, tokens: Path | None = None, hf_folder: Path | None = None,
    preemption: bool = False, procs: int | None = None, name: str = "cfg.yaml", data: dict | None = None,
) -> Path:  # fmt: skip
    """``configs/<recipe>.yaml`` at a tiny shape for ``procs`` processes: ``steps`` steps, a CSV loss every step,
    no validation, a checkpoint every 3 steps into ``tmp/ckpt``; text recipes read ``tokens`` (a token folder),
    or ``data`` (a whole ``data:`` block, e.g. a streaming module's) in its stead; ``finetune_debug`` starts from
    ``hf_folder``. ``preemption``: add ``Preemption(check_every_s=0)``. Written to ``tmp/name``; returns its path."""
    cfg = yaml.safe_load((REPO / "configs" / f"{recipe}.yaml").read_text())
    trainer = cfg["trainer"]
    trainer.update(
        devices=procs or CPU_RECIPES[recipe], max_steps=steps, limit_val_batches=0, log_every_n_steps=1,
        enable_progress_bar=False, num_sanity_val_steps=0,
        logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp / "runs"), "name": "t", "flush_logs_every_n_steps": 1}},
    )  # fmt: skip
    trainer.pop("val_check_interval", None)
    ckpt = next(c for c in trainer["callbacks"] if _is(c, "ModelCheckpoint"))
    ckpt["init_args"].update(dirpath=str(tmp / "ckpt"), every_n_train_steps=3)
    if preemption:
        trainer["callbacks"].insert(-1, {"class_path": "kempnerforge.callbacks.Preemption",
                                         "init_args": {"check_every_s": 0}})  # fmt: skip
    model = cfg["model"].get("init_args", cfg["model"])
    if recipe in TEXT_RECIPES:
        # pp_debug: its 4 pipeline micro-batches must divide the micro-batch.
        if data is not None:
            cfg["data"] = data
        else:
            cfg["data"].update(data_dir=str(tokens), seq_len=32, micro_batch_size=4 if recipe == "pp_debug" else 2)
        if recipe == "finetune_debug":
            model["init_from"] = str(hf_folder)
            cfg["data"]["tokenizer"] = str(REPO / "data" / "tokenizers" / "gpt2")
        else:
            model["config"].update(dim=64, max_seq_len=64, multiple_of=32)
    if recipe == "vlm_video":
        cfg["data"]["init_args"]["micro_batch_size"] = 1  # 3 training clips: one global batch of 2 per epoch
    path = tmp / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def _kill_once(cfg: Path, tmp: Path, rng: random.Random, result: KillResult, env: dict[str, str]) -> None:
    """Start the command, SIGTERM its process group after one or two new losses plus up to 0.4 s (mid-forward,
    -backward, -optimizer or -save), and record how it ended."""
    done = len(losses(tmp))
    proc = start(cfg, env)
    wait_for(lambda: len(losses(tmp)) >= done + rng.randint(1, 2), proc, timeout=WAIT_S)
    time.sleep(rng.uniform(0.0, 0.4))
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)  # every rank, the launcher and the dataloader workers, as a scheduler does
    try:
        result.codes.append(proc.wait(timeout=120))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    result.exit_s.append(time.monotonic() - sent)
    result.stopped_at.append(max(losses(tmp), default=-1) + 1)


def kill_recipe(
    root: Path, recipe: str, steps: int, kills: int, tokens: Path | None = None, hf_folder: Path | None = None,
    procs: int | None = None, seed: int | None = None, preemption_first: bool = False, data: dict | None = None,
) -> KillResult:  # fmt: skip
    """Kill ``recipe`` ``kills`` times, alternating between the recipe's own callbacks and an explicit ``Preemption``
    added (``preemption_first``: start with the latter), in one checkpoint folder (each run resumes the last), then
    finish it with the recipe's callbacks and compare every step's loss with an uninterrupted run's. ``data``: a
    text recipe's ``data:`` block instead of ``tokens`` (:func:`recipe_config`).

    Returns:
        A :class:`KillResult` (check ``ok``; the figures are for the report).
    """
    env = {"OMP_NUM_THREADS": "1"}
    kw = {"tokens": tokens, "hf_folder": hf_folder, "procs": procs, "data": data}
    (root / "reference").mkdir(parents=True), (root / "killed").mkdir()
    ref_cfg = recipe_config(root / "reference", recipe, steps, **kw)
    result = KillResult(recipe)
    # Waits under pytest's 600 s per test, so a stuck run fails here with its log (and its group is killed after
    # the test, tests/conftest.py) instead of a bare pytest-timeout.
    code = start(ref_cfg, env).wait(timeout=WAIT_S)
    assert code == 0, ref_cfg.with_suffix(".log").read_text()[-3000:]
    reference = losses(root / "reference")
    run = root / "killed"
    plain = recipe_config(run, recipe, steps, **kw)
    with_preemption = recipe_config(run, recipe, steps, preemption=True, name="cfg_preemption.yaml", **kw)
    rng = random.Random(seed)
    for i in range(kills):
        if len(losses(run)) >= steps - 2:
            break  # too few steps left to land a kill inside training
        _kill_once(with_preemption if (i % 2 == 1) != preemption_first else plain, run, rng, result, env)
    result.codes.append(start(plain, env).wait(timeout=WAIT_S))
    got = losses(run)
    if sorted(got) == sorted(reference):
        result.max_loss_diff = max(abs(got[s] - reference[s]) for s in reference)
    return result


def log_tail(root: Path, n: int = 3000) -> str:
    """The end of the killed runs' combined log (for assertion messages)."""
    texts = [p.read_text() for p in sorted((root / "killed").glob("*.log"))]
    return "\n".join(texts)[-n:]
