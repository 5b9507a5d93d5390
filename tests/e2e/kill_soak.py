"""SIGTERM to the process group of multi-process runs of the CPU recipes at random points until each run is done (a
script, not part of the suite; ``tests/e2e/test_recipe_kills.py`` runs one kill per recipe): every killed run must
exit 75 within 30 s and the stitched losses must equal an uninterrupted run's (1e-6). Kills alternate between the
recipe's own callbacks and an explicit ``Preemption``.

    python -m tests.e2e.kill_soak --recipes debug --procs 4 --kills 10 --steps 30
    python -m tests.e2e.kill_soak --recipes all --kills 2 --steps 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.preempt_helpers import REPO
from tests.e2e.recipe_kills import CPU_RECIPES, kill_recipe, log_tail


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the soak; print one JSON line per recipe (exit codes, seconds to exit, stop steps, largest loss
    difference) and exit 1 when any recipe failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--recipes", default="debug", help="comma-separated recipe names, or 'all': " + ", ".join(CPU_RECIPES)
    )
    p.add_argument(
        "--procs", type=int, default=None, help="processes (default: 2; the recipe's own when it needs more)"
    )
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    recipes = list(CPU_RECIPES) if args.recipes == "all" else args.recipes.split(",")
    root = Path(tempfile.mkdtemp(prefix="kill_soak_"))
    from kempnerforge.data.prepare import prepare_data
    from tests.hf_folders import tiny_llama_folder

    src = root / "head.txt"
    src.write_text((REPO / "data" / "tinyshakespeare" / "input.txt").read_text()[:100_000])
    tokens = root / "tokens"
    prepare_data(source=str(src), tokenizer=str(REPO / "data" / "tokenizers" / "gpt2"), output_dir=str(tokens))
    hf = tiny_llama_folder(root / "hf") if "finetune_debug" in recipes else None
    results, ok = [], True
    for recipe in recipes:
        started = time.monotonic()
        result = kill_recipe(root / recipe, recipe, args.steps, args.kills, tokens, hf, procs=args.procs)
        row = {**dataclasses.asdict(result), "ok": result.ok, "wall_s": round(time.monotonic() - started, 1)}
        print(json.dumps(row), flush=True)
        if not result.ok:
            print(log_tail(root / recipe), file=sys.stderr)
        ok &= result.ok
        results.append(row)
    if not ok:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
