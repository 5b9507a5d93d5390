"""Issue 28, check 2: the world collectives and host synchronizations of a dense 2-rank step are the same with the
strategy's own signal handling, a user's SIGTERM handler installed before ``fit``, and an explicit ``Preemption``;
and the count includes Lightning's: with the strategy's take-over turned off, Lightning's per-step SIGTERM
broadcast (one world broadcast, a blocking host-to-device copy and an ``.item()`` read-back per step) shows up, so the test would see it return."""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import HERE, launch

pytestmark = pytest.mark.distributed
SCRIPT = HERE / "collective_count_script.py"


@pytest.fixture(scope="module")
def counts(tmp_path_factory, shakespeare_tokens) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("collectives")
    found = {}
    for mode in ("default", "user", "preemption", "lightning"):
        out = tmp / mode
        launch(2, SCRIPT, ["--data", str(shakespeare_tokens), "--out", str(out), "--mode", mode])
        found[mode] = [json.loads((tmp / f"{mode}-rank{r}.json").read_text()) for r in range(2)]
    return found


def test_a_signal_handler_adds_no_collective_and_no_host_sync(counts):
    default = counts["default"]
    for rank in range(2):
        steps = default[rank]
        assert len(steps) >= 3 and all(s["collectives"] for s in steps.values())
        first = next(iter(steps.values()))
        assert all(s == first for s in steps.values()), steps  # every counted step alike
        assert first["syncs"] == ["tolist@kempnerforge/resilience/signals.py"], first["syncs"]  # NaNGuard's flags
        assert counts["user"][rank] == steps
        assert counts["preemption"][rank] == steps


def test_the_count_includes_lightnings_per_step_broadcast_when_it_runs(counts):
    for rank in range(2):
        ours, lightning = counts["default"][rank], counts["lightning"][rank]
        for step, s in ours.items():
            extra = list(lightning[step]["collectives"])
            for op in s["collectives"]:
                extra.remove(op)
            assert extra == ["broadcast_@2"], (step, extra)
            loop = "lightning/pytorch/loops/training_epoch_loop.py"  # its flag made on the device, then read back
            lightnings = [f"tensor(data, device=...)@{loop}", f"item@{loop}"]
            assert sorted(lightning[step]["syncs"]) == sorted([*s["syncs"], *lightnings]), step
