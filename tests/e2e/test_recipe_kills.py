"""SIGTERM to the process group of a 2-process run of every CPU recipe (the step loops that differ from
``configs/debug.yaml``'s, which ``test_preemption.py`` kills: pipeline schedule, MoE with expert load, context
parallel, fine-tuning from an HF folder, image and video loaders with worker processes): each killed run stops with
the "stopped early" status (75) within 30 s and the identical command finishes it with every step's loss equal to an
uninterrupted run's (1e-6).

One kill per recipe here, with the recipe's own callbacks for half of them and an explicit ``Preemption`` for the
other half; ``python -m tests.e2e.kill_soak --recipes all --kills 2`` kills every recipe both ways (the README's
figures come from that run).
"""

from __future__ import annotations

import pytest

from tests.e2e.recipe_kills import kill_recipe, log_tail
from tests.hf_folders import tiny_llama_folder

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: recipe -> whether its one kill adds an explicit Preemption (the recipes name none: False is the recipe as is).
SUITE = {"pp_debug": False, "moe_debug": True, "cp_debug": False, "finetune_debug": True, "vlm_jd": False,
         "vlm_video": True}  # fmt: skip


@pytest.mark.parametrize("recipe", sorted(SUITE))
def test_sigterm_to_the_group_stops_75_and_the_rerun_matches(recipe, tmp_path, shakespeare_tokens):
    hf = tiny_llama_folder(tmp_path / "hf") if recipe == "finetune_debug" else None
    result = kill_recipe(
        tmp_path, recipe, steps=6, kills=1, tokens=shakespeare_tokens, hf_folder=hf, preemption_first=SUITE[recipe]
    )
    print(result)
    killed = result.codes[:-1]
    assert killed == [75] and result.codes[-1] == 0 and max(result.exit_s) < 30, (result, log_tail(tmp_path))
    assert 0 < result.stopped_at[0] < 6
    assert result.max_loss_diff <= 1e-6, (result, log_tail(tmp_path))
