"""Write every figure the docs and the recipes quote from a command, from that command's output.

A *quote* is a piece of text in a file (a recipe's header, the README, a docs page) with ``{source.value:format}``
placeholders where its figures go. A *source* is a command whose output gives those values: ``kforge estimate`` of a
recipe on a simulated cluster (:data:`ESTIMATES`), a recipe's parameter counts (:data:`CONFIGS`), or the quick
start's training run (``quickstart``: the validation loss ``kforge fit --config configs/debug.yaml`` reaches). This
script runs the sources and writes the figures into every quote; ``tests/e2e/test_estimate_recipes.py`` and
``tests/e2e/test_quickstart.py`` compute the same sources and fail when a quoted figure differs from what the command
prints by more than :data:`TOLERANCE` (a recipe whose shape changed without its comment, a stale README).

    python scripts/refresh_figures.py                 # every estimate and count (about 3 minutes on 2 cores)
    python scripts/refresh_figures.py --quickstart    # also the quick start's 100-step run (about 4 more)
    python scripts/refresh_figures.py --check         # report the quotes that differ, write nothing

Figures that depend on the machine (times, tokens/s) are not quoted from here: where the docs give one they say on
what machine and when it was measured.
"""

from __future__ import annotations

import argparse
import json
import re
import string
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
#: A quoted figure may differ from the command's by this much (relative; or by the rounding to the digits it is
#: written with, when that is more) before a test fails.
TOLERANCE = 0.02
GB = 1e9
_NUMBER = r"([0-9][0-9,]*(?:\.[0-9]+)?)"


@dataclass(frozen=True)
class Estimate:
    """``kforge estimate --config configs/<recipe>.yaml --num_nodes N --devices_per_node G <overrides>``.

    ``folders``: the recipe needs config.json-only Hugging Face folders (``llama31``: Llama-3.1-8B through
    ``init_from``; ``siglip``: SigLIP so400m as the encoder), made in a temporary folder (no weights are read).
    ``base``: another source whose FLOPs this one is compared with (``flops_increase_pct``)."""

    recipe: str
    nodes: int
    devices: int
    overrides: tuple[str, ...] = ()
    folders: tuple[str, ...] = ()
    alternatives: bool = False
    base: str | None = None


AC = "--trainer.strategy.init_args.activation_checkpointing"
#: Every estimate a quote names, by source name.
ESTIMATES: dict[str, Estimate] = {
    "llama3_8b": Estimate("llama3_8b", 1, 8),
    "llama3_8b_noac": Estimate("llama3_8b", 1, 8, (f"{AC}=none",)),
    "llama3_8b_fullac": Estimate("llama3_8b", 1, 8, (f"{AC}=full",), base="llama3_8b"),
    "llama3_8b_1gpu": Estimate("llama3_8b", 1, 1, alternatives=True),
    "llama3_70b": Estimate("llama3_70b", 8, 8),
    "llama3_70b_noac": Estimate("llama3_70b", 8, 8, (f"{AC}=none",)),
    "llama3_70b_fullac": Estimate("llama3_70b", 8, 8, (f"{AC}=full",), base="llama3_70b"),
    "moe_16b_2x8": Estimate("moe_16b", 2, 8),
    "moe_16b_8x8": Estimate("moe_16b", 8, 8),
    "moe_16b_2x8_noac": Estimate("moe_16b", 2, 8, (f"{AC}=none",)),
    "pp_7b": Estimate("7b_pp", 1, 4),
    "finetune_llama": Estimate("finetune_llama", 1, 8, folders=("llama31",)),
    "llama31_128k": Estimate("llama31_8b_128k", 1, 8, folders=("llama31",)),
    "llama31_128k_cp1": Estimate("llama31_8b_128k", 1, 8, ("--trainer.strategy.init_args.cp=1",), ("llama31",)),
    "vlm_7b_stage1": Estimate("vlm_7b_siglip2", 2, 4, folders=("llama31_vlm", "siglip")),
    "vlm_7b_stage2": Estimate(
        "vlm_7b_siglip2", 2, 4, ("--model.init_args.freeze.backbone=false",), ("llama31_vlm", "siglip")
    ),
}
#: Recipes whose parameter counts a quote names (``<recipe>_cfg``): total and active per token, from the config.
CONFIGS = ("llama3_8b", "llama3_70b", "moe_16b", "7b_pp", "debug")


@dataclass(frozen=True)
class Quote:
    """``template`` appears in ``file`` with its figures filled in (``{source.value:format}``)."""

    file: str
    template: str

    def fields(self) -> list[tuple[str, str, int]]:
        """``(source, value, decimals written)`` of each placeholder, in order."""
        return [(*name.split(".", 1), int(re.search(r"\.(\d+)f", spec).group(1)))
                for _, name, spec, _ in string.Formatter().parse(self.template) if name]  # fmt: skip

    def pattern(self) -> re.Pattern:
        """The template with each placeholder as a number: finds the quote whatever its figures are now."""
        parts = [
            re.escape(text) + (_NUMBER if name else "") for text, name, _, _ in string.Formatter().parse(self.template)
        ]
        return re.compile("".join(parts))

    def sources(self) -> set[str]:
        return {source for source, _, _ in self.fields()}


# The quotes: the estimate sentences of the cluster recipes' headers, the recipe table, the pages that repeat a
# recipe's figures, the parameter counts and the quick start's loss.
QUOTES: list[Quote] = [
    # configs/llama3_8b.yaml
    Quote("configs/llama3_8b.yaml", "untied head: {llama3_8b_cfg.params_b:.2f}B parameters)"),
    Quote(
        "configs/llama3_8b.yaml",
        "(measured): fits, per rank\n# {llama3_8b.params:.2f} GB parameters + {llama3_8b.grads:.2f} GB gradients + "
        "{llama3_8b.optimizer:.2f} GB AdamW states (1/{llama3_8b.sharding:.0f} each), peak {llama3_8b.peak:.2f} GB "
        "({llama3_8b.activations:.2f} GB activations\n# with selective AC; the fused head + chunked cross-entropy "
        "holds no logits), headroom {llama3_8b.headroom:.1f} GB of 80 GB (after the\n# allowance: CUDA context, NCCL "
        "buffers, cuBLAS workspaces, 5% fragmentation); {llama3_8b.tflop:.0f} TFLOP per step per rank;\n# all-gather "
        "{llama3_8b.all_gather_dp_shard:.1f} GB + reduce-scatter {llama3_8b.reduce_scatter_dp_shard:.1f} GB per step. "
        "Without AC the peak is {llama3_8b_noac.peak:.1f} GB (does not fit with the\n# allowance); with full AC "
        "{llama3_8b_fullac.peak:.1f} GB at {llama3_8b_fullac.flops_increase_pct:.0f}% more FLOPs. On one GPU it does "
        "not fit ({llama3_8b_1gpu.peak:.1f} GB peak): the estimate\n# suggests {llama3_8b_1gpu.suggested_gpus:.0f} "
        "GPUs (peak {llama3_8b_1gpu.suggested_peak:.2f} GB, needs {llama3_8b_1gpu.suggested_needed:.2f} GB per rank, "
        "estimated at that size).",
    ),
    # configs/llama3_70b.yaml
    Quote("configs/llama3_70b.yaml", "vocabulary 128,256, untied head: {llama3_70b_cfg.params_b:.1f}B parameters)"),
    Quote(
        "configs/llama3_70b.yaml",
        "(measured): fits, per rank\n# {llama3_70b.params:.2f} GB parameters + {llama3_70b.grads:.2f} GB gradients + "
        "{llama3_70b.optimizer:.2f} GB AdamW states (1/{llama3_70b.sharding:.0f} each), peak {llama3_70b.peak:.2f} GB "
        "({llama3_70b.activations:.1f} GB activations\n# with selective AC and sequence parallelism), headroom "
        "{llama3_70b.headroom:.1f} GB of 80 GB; {llama3_70b.tflop:.0f} TFLOP per step per rank; per step\n# "
        "{llama3_70b.all_gather_tp:.1f} GB TP all-gather + {llama3_70b.reduce_scatter_tp:.1f} GB TP reduce-scatter "
        "(in the node), {llama3_70b.all_gather_dp_shard:.1f} GB FSDP all-gather + "
        "{llama3_70b.reduce_scatter_dp_shard:.1f} GB reduce-scatter\n# (across nodes). Without AC the peak is "
        "{llama3_70b_noac.peak:.1f} GB (headroom {llama3_70b_noac.headroom:.1f} GB); with full AC "
        "{llama3_70b_fullac.peak:.1f} GB at {llama3_70b_fullac.flops_increase_pct:.0f}% more FLOPs.",
    ),
    # configs/moe_16b.yaml
    Quote(
        "configs/moe_16b.yaml",
        "block, vocabulary 102,400, untied head): {moe_16b_cfg.params_b:.1f}B parameters, "
        "{moe_16b_cfg.active_b:.1f}B active per token.",
    ),
    Quote(
        "configs/moe_16b.yaml",
        "(measured): fits, per rank\n# {moe_16b_2x8.params:.2f} GB parameters + {moe_16b_2x8.grads:.2f} GB gradients + "
        "{moe_16b_2x8.optimizer:.2f} GB AdamW states (1/{moe_16b_2x8.sharding:.0f} each), peak "
        "{moe_16b_2x8.peak:.2f} GB ({moe_16b_2x8.activations:.1f} GB activations\n# with selective AC), headroom "
        "{moe_16b_2x8.headroom:.1f} GB of 80 GB (the allowance counts {moe_16b_2x8.nccl:.2f} GB of NCCL buffers, the ep "
        "all-to-all's\n# connections to 7 peers most of it); {moe_16b_2x8.tflop:.0f} TFLOP per step per rank; "
        "{moe_16b_2x8.all_to_all_ep:.1f} GB of EP all-to-all per step (balanced\n# routing assumed). At 8 x 8 "
        "(dp_shard=64): peak {moe_16b_8x8.peak:.2f} GB, headroom {moe_16b_8x8.headroom:.1f} GB. Without AC at 2 x 8 "
        "the peak is\n# {moe_16b_2x8_noac.peak:.1f} GB (headroom {moe_16b_2x8_noac.headroom:.1f} GB).",
    ),
    # configs/7b_pp.yaml
    Quote("configs/7b_pp.yaml", "# vocabulary: {7b_pp_cfg.params_b:.1f}B parameters)"),
    Quote(
        "configs/7b_pp.yaml",
        "(measured): fits on 80 GB GPUs;\n# pp rank 0 (stages 0, 2) peaks at {pp_7b.role0_peak:.2f} GB, pp rank 1 "
        "(stages 1, 3, with the head) at {pp_7b.role1_peak:.2f} GB: {pp_7b.params:.2f} GB\n# parameters + "
        "{pp_7b.grads:.2f} GB gradients + {pp_7b.optimizer:.2f} GB AdamW states per rank",
    ),
    # configs/finetune_llama.yaml
    Quote(
        "configs/finetune_llama.yaml",
        "Measured: fits, per rank {finetune_llama.params:.2f} GB\n#     parameters + {finetune_llama.grads:.2f} GB "
        "gradients + {finetune_llama.optimizer:.2f} GB AdamW states, peak {finetune_llama.peak:.1f} GB "
        "({finetune_llama.activations:.1f} GB activations with selective AC,\n#     packed chat rows with document "
        "masking), headroom {finetune_llama.headroom:.1f} GB of 80 GB; {finetune_llama.tflop:.0f} TFLOP per step "
        "per rank",
    ),
    # configs/llama31_8b_128k.yaml
    Quote(
        "configs/llama31_8b_128k.yaml",
        "Estimated: fits, per rank {llama31_128k.params:.2f} GB parameters + {llama31_128k.grads:.2f} GB gradients + "
        "{llama31_128k.optimizer:.2f} GB AdamW states, peak {llama31_128k.peak:.2f} GB\n#     "
        "({llama31_128k.activations:.2f} GB activations with full AC, {llama31_128k.temporaries:.2f} GB temporaries), "
        "headroom {llama31_128k.headroom:.1f} GB of 80 GB; {llama31_128k.tflop:,.0f} TFLOP per step per\n#     rank. "
        "With cp=1 (dp_shard=8, a whole sequence per rank): peak {llama31_128k_cp1.peak:.1f} GB, does not fit.",
    ),
    # configs/vlm_7b_siglip2.yaml
    Quote(
        "configs/vlm_7b_siglip2.yaml",
        "fits, peak {vlm_7b_stage1.peak:.2f} GB + {vlm_7b_stage1.allowance:.2f} GB allowance =\n# "
        "{vlm_7b_stage1.needed:.2f} GB per rank in stage 1 (the connector trains; the AdamW states of the backbone are "
        "already held: {vlm_7b_stage1.optimizer:.2f} GB),\n# {vlm_7b_stage2.peak:.2f} GB + "
        "{vlm_7b_stage2.allowance:.2f} GB allowance = {vlm_7b_stage2.needed:.2f} GB in stage 2",
    ),
    # the recipe table (docs/how-to/recipes.md)
    Quote(
        "docs/how-to/recipes.md",
        "LLaVA two-stage freezing; estimated peak {vlm_7b_stage1.peak:.1f} GB per GPU on 2 x 4 "
        "({vlm_7b_stage2.peak:.1f} GB in stage 2)",
    ),
    Quote(
        "docs/how-to/recipes.md",
        "`cp=8`, full AC; estimated peak {llama31_128k.peak:.1f} GB per GPU ({llama31_128k_cp1.peak:.1f} GB, does "
        "not fit, at `cp=1`)",
    ),
    Quote("docs/how-to/recipes.md", "bf16 compute, full AC; estimated peak {pp_7b.peak:.1f} GB per GPU"),
    Quote(
        "docs/how-to/recipes.md",
        "Llama-3-8B shape ({llama3_8b_cfg.params_b:.2f}B) on 1 node x 8 x 80 GB, FSDP2, bf16 compute, selective (op) "
        "AC, 8k sequences; estimated peak {llama3_8b.peak:.1f} GB per GPU",
    ),
    Quote(
        "docs/how-to/recipes.md",
        "Llama-3-70B shape ({llama3_70b_cfg.params_b:.1f}B) on 8 nodes x 8 x 80 GB, TP=8 + sequence parallel in the "
        "node x FSDP2 across nodes, selective AC; estimated peak {llama3_70b.peak:.1f} GB per GPU",
    ),
    Quote(
        "docs/how-to/recipes.md",
        "DeepSeek-V2-Lite-shaped MoE ({moe_16b_cfg.params_b:.1f}B total, {moe_16b_cfg.active_b:.1f}B active: 64 "
        "fine-grained experts top-6 + 2 shared, MHA instead of MLA) on 2 nodes x 8, ep=8 x FSDP2; estimated peak "
        "{moe_16b_2x8.peak:.1f} GB per GPU ({moe_16b_8x8.peak:.1f} GB at 8 nodes)",
    ),
    # pages that repeat a recipe's figures
    Quote(
        "docs/how-to/context-parallel.md",
        "fits on 8 x 80 GB at `cp=8` ({llama31_128k.peak:.1f} GB per GPU) and does not at `cp=1` "
        "({llama31_128k_cp1.peak:.1f} GB)",
    ),
    Quote(
        "docs/how-to/finetune-hf.md",
        "`kforge estimate` with only the folder's `config.json`: fits, peak {finetune_llama.peak:.1f} GB per rank",
    ),  # fmt: skip
    # the quick start
    Quote(
        "README.md",
        "validation loss {quickstart.val_loss:.2f} at step 100, where a uniform guess scores ln 50257 = 10.8)",
    ),
    Quote("docs/index.md", "its validation loss at step 100 is {quickstart.val_loss:.2f}"),
    Quote("configs/debug.yaml", "val loss {quickstart.val_loss:.2f} at step 100, chance 10.8)"),
    Quote("README.md", "Train a {debug_cfg.params_m:.0f}M-parameter Llama-style model"),
]


# -- sources ---------------------------------------------------------------------------------------------------------


def hf_folders(root: Path) -> dict[str, Path]:
    """config.json-only folders of Llama-3.1-8B (``llama31``, and a copy for the VLM, ``llama31_vlm``) and of
    SigLIP so400m's vision tower (``siglip``): what the recipes' estimates read (no weights)."""
    from tests.hf_folders import llama31_8b_config, siglip_so400m

    return {"llama31": llama31_8b_config(root / "llama31"), "llama31_vlm": llama31_8b_config(root / "llama31_vlm"),
            "siglip": siglip_so400m(root / "siglip")}  # fmt: skip


def estimate_args(source: Estimate, folders: dict[str, Path]) -> list[str]:
    """The ``kforge fit`` arguments of an estimate source (its recipe, the folders it reads, its overrides)."""
    args = ["--config", str(REPO / "configs" / f"{source.recipe}.yaml")]
    prefix = "--model.init_args." if source.recipe.startswith("vlm") else "--model."
    for name in source.folders:
        if name.startswith("llama31"):
            args.append(f"{prefix}init_from={folders[name]}")
        else:
            args.append(f"{prefix}encoder.pretrained_path={folders[name]}")
    return [*args, *source.overrides]


def estimate_values(data: dict) -> dict[str, float]:
    """The figures of one estimate's JSON (``Estimate.to_json``), in GB (1e9 bytes), TFLOP and billions."""
    roles = data["roles"]
    first = roles[0]
    verdict = data["verdict"] or {}
    peak = max(r["peak_bytes"] for r in roles)
    values = {
        "params": first["params_bytes"] / GB,
        "grads": first["grads_bytes"] / GB,
        "optimizer": first["optimizer_bytes"] / GB,
        # "peak P GB (A GB activations, T GB temporaries)": the composition of the peak, as the report prints it
        "activations": first["peak_breakdown"].get("activations", 0) / GB,
        "temporaries": first["peak_breakdown"].get("temporaries", 0) / GB,
        "peak": peak / GB,
        "sharding": first["sharding"],
        "tflop": max(r["flops"] for r in roles) / 1e12,
        "flops": max(r["flops"] for r in roles),
        "model_params_b": data["model_params"] / 1e9,
        "headroom": verdict.get("headroom_bytes", 0) / GB,
        "needed": verdict.get("needed_bytes", 0) / GB,
        "allowance": (verdict.get("needed_bytes", peak) - peak) / GB,
        "nccl": (verdict.get("allowance") or {}).get("nccl", 0) / GB,
    }
    for i, role in enumerate(roles):
        values[f"role{i}_peak"] = role["peak_bytes"] / GB
    for key, nbytes in first["comm"].items():
        values[re.sub(r"\W+", "_", key).strip("_")] = nbytes / GB
    suggestions = verdict.get("suggestions") or []
    size = re.search(r"--num_nodes (\d+) --devices_per_node (\d+)", suggestions[0]["change"]) if suggestions else None
    if size:  # the first suggestion is more GPUs: how many, and the peak and need estimated at that size
        values["suggested_gpus"] = int(size.group(1)) * int(size.group(2))
        values["suggested_peak"] = suggestions[0]["peak_bytes"] / GB
        values["suggested_needed"] = suggestions[0]["needed_bytes"] / GB
    return values


def run_estimates(names: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the estimate sources ``names`` (all by default) in this process; their figures by source name."""
    from kempnerforge.estimate import estimate

    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = hf_folders(Path(tmp))
        for name in names or list(ESTIMATES):
            source = ESTIMATES[name]
            print(f"[figures] kforge estimate {source.recipe} {source.nodes} x {source.devices} {source.overrides}",
                  file=sys.stderr, flush=True)  # fmt: skip
            est = estimate(estimate_args(source, folders), source.nodes, source.devices,
                           alternatives=source.alternatives)  # fmt: skip
            out[name] = estimate_values(json.loads(json.dumps(est.to_json())))
    return with_derived(out)


def with_derived(values: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Add the figures that compare two sources (``flops_increase_pct`` against the source's ``base``)."""
    for name, source in ESTIMATES.items():
        if source.base and name in values and source.base in values:
            values[name]["flops_increase_pct"] = 100 * (values[name]["flops"] / values[source.base]["flops"] - 1)
    return values


def config_values(recipe: str) -> dict[str, float]:
    """A recipe's parameter counts from its ``model.config`` (total and active per token)."""
    import yaml

    from kempnerforge.config import ModelConfig

    cfg = ModelConfig(**yaml.safe_load((REPO / "configs" / f"{recipe}.yaml").read_text())["model"]["config"])
    return {"params_b": cfg.num_params() / 1e9, "active_b": cfg.num_active_params() / 1e9,
            "params_m": cfg.num_params() / 1e6}  # fmt: skip


def all_config_values() -> dict[str, dict[str, float]]:
    return {f"{recipe}_cfg": config_values(recipe) for recipe in CONFIGS}


# -- writing and checking quotes -------------------------------------------------------------------------------------


def _namespace(values: dict[str, dict[str, float]]) -> dict[str, SimpleNamespace]:
    return {name: SimpleNamespace(**v) for name, v in values.items()}


def _render(quote: Quote, values: dict[str, dict[str, float]]) -> str:
    # str.format reads "{7b_pp_cfg.x}" as a positional index: give every source a keyword-safe alias.
    aliases = {name: f"s{i}" for i, name in enumerate(values)}
    template = quote.template
    for name, alias in aliases.items():
        template = template.replace("{" + name + ".", "{" + alias + ".")
    return template.format(**{aliases[n]: ns for n, ns in _namespace(values).items()})


def refresh(values: dict[str, dict[str, float]], write: bool = True) -> list[str]:
    """Fill every quote whose sources are all in ``values``; the quotes that changed (``write=False``: only report).

    Raises:
        LookupError: a quote's text is no longer in its file (its prose was edited: edit the template here too).
    """
    changed = []
    for quote in QUOTES:
        if not quote.sources() <= set(values):
            continue
        path = REPO / quote.file
        text = path.read_text()
        found = list(quote.pattern().finditer(text))
        if len(found) != 1:
            raise LookupError(f"{quote.file}: the quote is found {len(found)} times (must be once):\n{quote.template}")
        new = _render(quote, values)
        if found[0].group(0) != new:
            changed.append(f"{quote.file}: {found[0].group(0)!r} -> {new!r}")
            if write:
                path.write_text(text[: found[0].start()] + new + text[found[0].end() :])
    return changed


def differences(values: dict[str, dict[str, float]], files: dict[str, str] | None = None) -> list[str]:
    """Each quoted figure (of the quotes whose sources are in ``values``) that differs from the source's value by more
    than :data:`TOLERANCE`, or a quote no longer found once in its file; ``files`` overrides the files' text."""
    problems = []
    for quote in QUOTES:
        if not quote.sources() <= set(values):
            continue
        text = (files or {}).get(quote.file)
        text = (REPO / quote.file).read_text() if text is None else text
        found = list(quote.pattern().finditer(text))
        if len(found) != 1:
            problems.append(f"{quote.file}: quote found {len(found)} times:\n{quote.template}")
            continue
        for (source, name, decimals), written in zip(quote.fields(), found[0].groups(), strict=True):
            expected = values[source][name]
            quoted = float(written.replace(",", ""))
            # 2% of the value, or the rounding to the digits written (0.47 GB quoted as "0.5"), whichever is larger
            if abs(quoted - expected) > max(TOLERANCE * abs(expected), 0.5 * 10**-decimals):
                problems.append(f"{quote.file}: {source}.{name} is quoted as {written}, the command gives "
                                f"{expected:.4g} (refresh: python scripts/refresh_figures.py)")  # fmt: skip
    return problems


def quickstart_values() -> dict[str, float]:
    """The quick start's run, ``kforge fit --config configs/debug.yaml`` as the README gives it (logs and checkpoints
    in a temporary folder): the last validation loss."""
    import csv
    import os
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "kempnerforge.cli", "fit", "--config", "configs/debug.yaml",
               f"--data.data_dir={tmp}/tokens", "--trainer.enable_progress_bar=false",
               "--trainer.logger.class_path=lightning.pytorch.loggers.CSVLogger",
               f"--trainer.logger.init_args.save_dir={tmp}/runs", f"--trainer.callbacks.init_args.dirpath={tmp}/ckpt"]  # fmt: skip
        subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        (metrics,) = Path(tmp, "runs").rglob("metrics.csv")
        val = [float(r["val/loss"]) for r in csv.DictReader(metrics.open()) if r.get("val/loss")]
    return {"val_loss": val[-1]}


def main(argv: list[str] | None = None) -> None:
    """Run the sources and write (or ``--check``) every quote."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report the quotes that differ; write nothing")
    parser.add_argument("--quickstart", action="store_true", help="also run the quick start (about 4 minutes)")
    parser.add_argument("--only", default=None, help="comma-separated estimate sources (default: all)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    values = {**run_estimates(args.only.split(",") if args.only else None), **all_config_values()}
    if args.quickstart:
        values["quickstart"] = quickstart_values()
    if args.check:
        problems = differences(values)
        print("\n".join(problems) or "every quoted figure is within 2% of its command's")
        raise SystemExit(1 if problems else 0)
    for line in refresh(values):
        print(line)


if __name__ == "__main__":
    main()
