"""Issue 16, check 6: every recipe in configs/ (and every configs/recipes/ overlay) is trained by a test or
estimated by one. The list is explicit: a recipe added without a test (or a test that stops naming its recipe)
fails here."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: recipe (path under configs/, without .yaml) -> (how, the test file that does it, relative to tests/)
COVERAGE: dict[str, tuple[str, str]] = {
    "debug": ("trained", "e2e/test_quickstart.py"),
    "moe_debug": ("trained", "e2e/test_moe_recipe.py"),
    "pp_debug": ("trained", "e2e/test_pp_recipe.py"),
    "cp_debug": ("trained", "e2e/test_cp_recipe.py"),
    "vlm_jd": ("trained", "e2e/test_vlm_recipes.py"),
    "vlm_cross_attn": ("trained", "e2e/test_vlm_recipes.py"),
    "vlm_mot": ("trained", "e2e/test_vlm_recipes.py"),
    "vlm_moma": ("trained", "e2e/test_vlm_recipes.py"),
    "vlm_video": ("trained", "e2e/test_vlm_video_recipe.py"),
    "llama3_8b": ("estimated", "e2e/test_estimate_recipes.py"),
    "finetune_llama": ("estimated", "e2e/test_estimate_recipes.py"),
    "finetune_debug": ("trained", "e2e/test_finetune_recipe.py"),
    "llama3_70b": ("estimated", "e2e/test_estimate_recipes.py"),
    "llama31_8b_128k": ("estimated", "e2e/test_estimate_recipes.py"),
    "moe_16b": ("estimated", "e2e/test_estimate_recipes.py"),
    "7b_pp": ("estimated", "e2e/test_estimate_recipes.py"),
    "vlm_7b_siglip2": ("estimated", "e2e/test_estimate_recipes.py"),
    "recipes/adamw_cosine": ("estimated", "unit/test_estimate.py"),
    "recipes/adamw_linear": ("estimated", "unit/test_estimate.py"),
    "recipes/adamw_none": ("estimated", "unit/test_estimate.py"),
    "recipes/lion_rex": ("estimated", "unit/test_estimate.py"),
    "recipes/muon_wsd": ("estimated", "unit/test_estimate.py"),
    "recipes/schedule_free_constant": ("estimated", "unit/test_estimate.py"),
}


def test_every_recipe_is_trained_or_estimated_by_a_test():
    configs = REPO / "configs"
    found = {p.relative_to(configs).with_suffix("").as_posix() for p in configs.rglob("*.yaml")}
    assert found == set(COVERAGE), (
        f"recipes without a test: {sorted(found - set(COVERAGE))}; listed but gone: {sorted(set(COVERAGE) - found)}"
    )
    for recipe, (how, test) in COVERAGE.items():
        assert how in ("trained", "estimated")
        text = (REPO / "tests" / test).read_text()
        assert Path(recipe).name in text, f"{test} does not name {recipe}"
