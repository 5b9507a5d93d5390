"""Replica-group fault tolerance (``KempnerStrategy(fault_tolerance=...)``, torchft) on CPU / gloo.

Oracles: plain HSDP on one world (2 groups x 2 ranks must equal dp_replicate=2 x dp_shard=2), the survivor's own
state (a healed group must equal it bitwise), an uninterrupted run (a whole-job restart from DCP must equal it).
"""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.forked_ranks import run_ranks
from tests.distributed.replica_launch import SCRIPT, Group, lighthouse

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not __import__("importlib").util.find_spec("torchft"), reason="torchft not installed"),
]

STEPS = 10


def _load(out: Path, group: int, rank: int) -> dict:
    return torch.load(out / f"g{group}_r{rank}.pt", weights_only=False)


def _run_groups(
    out: Path, tmp: Path, n: int, extra: list[list[str]], min_replicas: int, timeout: float = 240
) -> list[Group]:
    """Launch ``n`` groups of 2 ranks at once (``extra[g]``: group g's own arguments) and wait for all of them."""
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    with lighthouse(min_replicas=min_replicas) as address:
        env = {"TORCHFT_LIGHTHOUSE": address}
        groups = [
            Group(f"{out.name}-g{g}", 2, [*extra[g], "--group", str(g), "--groups", str(n)], env, logs)
            for g in range(n)
        ]
        codes = [g.wait(timeout) for g in groups]
    return groups, codes


@pytest.fixture(scope="module")
def uninterrupted(shakespeare_tokens, tmp_path_factory) -> Path:
    """2 groups x 2 ranks, 10 steps, no failure (both groups in the first quorum: the lighthouse waits for 2)."""
    tmp = tmp_path_factory.mktemp("ft_uninterrupted")
    out = tmp / "out"
    out.mkdir()
    common = ["--data", str(shakespeare_tokens), "--out", str(out), "--steps", str(STEPS)]
    groups, codes = _run_groups(out, tmp, 2, [common, common], min_replicas=2)
    assert codes == [[0, 0], [0, 0]], "\n".join(g.log()[-3000:] for g in groups)
    return out


def test_two_groups_equal_plain_hsdp(uninterrupted, shakespeare_tokens, tmp_path):
    """Check 1: 2 replica groups x dp_shard=2 train exactly as HSDP dp_replicate=2 x dp_shard=2 in one world: the
    same data shards (group g, rank d reads shard 2g + d of 4), the step's token count and gradients summed over the
    groups. Losses and every rank's parameter shard agree within 1e-6 after 10 steps (1e-6: a few fp32 roundings of
    O(1) values; the two runs sum the same four terms in another order at most)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--data", str(shakespeare_tokens), "--out", str(tmp_path), "--steps", str(STEPS), "--dp-replicate", "2"]
    proc = run_ranks(4, SCRIPT, args, env, 240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(4):
        hsdp = _load(tmp_path, 0, rank)
        group, group_rank = divmod(rank, 2)
        ft = _load(uninterrupted, group, group_rank)
        assert ft["steps"] == hsdp["steps"] == list(range(1, STEPS + 1))
        assert ft["losses"] == pytest.approx(hsdp["losses"], abs=1e-6)
        assert hsdp["losses"][-1] < hsdp["losses"][0] - 0.5  # it trained
        if rank == 0:  # the norm before clipping: Adam and clipping would hide a wrong gradient scale, the norm not
            assert ft["grad_norms"] == pytest.approx(hsdp["grad_norms"], rel=1e-6)
        for name, value in hsdp["params"].items():
            torch.testing.assert_close(ft["params"][name], value, rtol=0, atol=1e-6, msg=name)


def _wait_for(pattern: str, group: Group, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, group.log())
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{group.log()[-4000:]}")


def test_killed_group_heals_from_survivor(shakespeare_tokens, tmp_path):
    """Check 2: group 1 is SIGKILLed in the middle of a random step; group 0 keeps stepping (its counter never goes back, one
    line says the quorum shrank), group 1 restarted from nothing heals from group 0 (one line with the heal time,
    < 30 s) and both finish at max_steps with every rank's parameters and optimizer state bitwise equal."""
    die_at = random.Random().randint(2, 5)
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    steps = 18
    common = ["--data", str(shakespeare_tokens), "--out", str(out), "--steps", str(steps), "--sleep", "0.3"]
    with lighthouse(min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=1000) as address:
        env = {"TORCHFT_LIGHTHOUSE": address}
        survivor = Group("g0", 2, [*common, "--group", "0"], env, logs)
        victim = Group("g1a", 2, [*common, "--group", "1", "--die-at", str(die_at)], env, logs)
        assert victim.wait(180) == [-9, -9], victim.log()[-4000:]
        _wait_for(r"Replica group 0: quorum \d+ at step \d+: groups \[0\] of 2; left: \[1\]", survivor, 60)
        restarted = time.monotonic()
        rejoined = Group("g1b", 2, [*common, "--group", "1"], env, logs)
        _wait_for(r"this group healed from a live group", rejoined, 60)
        rejoin_seconds = time.monotonic() - restarted  # process start + setup + quorum + transfer
        codes = rejoined.wait(180), survivor.wait(180)
    log0, log1 = survivor.log(), rejoined.log()
    assert codes == ([0, 0], [0, 0]), f"die_at={die_at}\n{log0[-3000:]}\n{log1[-3000:]}"
    heal = re.search(
        r"Replica group 1: quorum \d+ at step (\d+): groups \[0, 1\] of 2; this group healed from a live group in ([\d.]+) s",
        log1,
    )
    assert heal, log1[-4000:]
    healed_at, seconds = int(heal.group(1)), float(heal.group(2))
    assert healed_at > die_at and seconds < 30 and rejoin_seconds < 30, (healed_at, seconds, rejoin_seconds)
    assert re.search(r"Replica group 0: quorum \d+ at step \d+: groups \[0, 1\] of 2; joined: \[1\]", log0)
    # Group 1 died mid-step (after the step's quorum, before its gradients were summed): group 0's step failed, was
    # dropped with one line, and its counter stayed (the same step counted again after that batch).
    assert f"Replica group 0: step {die_at} not committed" in log0
    for rank in range(2):
        a, b = _load(out, 0, rank), _load(out, 1, rank)
        assert a["steps"] == sorted(a["steps"]) and a["steps"][-1] == steps  # never back, ends at max_steps
        assert a["steps"].count(die_at) >= 2
        assert b["steps"][0] == healed_at + 1 and b["steps"][-1] == steps  # continues at the survivor's step
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
            for key in a["optim"][name]:
                assert torch.equal(a["optim"][name][key], b["optim"][name][key]), (name, key)
        assert a["lr"] == b["lr"]


def test_whole_job_restart_resumes_exactly(uninterrupted, shakespeare_tokens, tmp_path):
    """Check 4: both groups save DCP checkpoints every 3 steps (each into its own replica_group_<g> folder) and are
    SIGKILLed after step 5; relaunched with ``--ckpt_path auto`` they resume from step 3 and end equal to the
    uninterrupted run: the losses of steps 4-10 and every parameter shard (1e-6, as check 1: same sums, same order)."""
    out = tmp_path / "out"
    out.mkdir()
    ckpt = tmp_path / "ckpt"
    common = ["--data", str(shakespeare_tokens), "--out", str(out), "--steps", str(STEPS), "--ckpt-dir", str(ckpt)]
    first = [*common, "--ckpt-every", "3", "--die-at", "5"]
    groups, codes = _run_groups(out, tmp_path, 2, [first, first], min_replicas=2)
    assert all(code == [-9, -9] for code in codes), "\n".join(g.log()[-3000:] for g in groups)
    assert sorted(p.name for p in (ckpt / "replica_group_0").glob("*.ckpt")) == ["step=0003.ckpt"]
    again = [*common, "--resume", "auto"]
    groups, codes = _run_groups(out, tmp_path, 2, [again, again], min_replicas=2)
    assert codes == [[0, 0], [0, 0]], "\n".join(g.log()[-3000:] for g in groups)
    for group in range(2):
        for rank in range(2):
            resumed, ref = _load(out, group, rank), _load(uninterrupted, group, rank)
            assert resumed["steps"] == list(range(4, STEPS + 1))
            assert resumed["losses"] == pytest.approx(ref["losses"][3:], abs=1e-6)
            for name, value in ref["params"].items():
                torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-6, msg=name)


def test_three_groups_two_failures_each_rejoins(shakespeare_tokens, tmp_path):
    """Check 3: 3 groups; group 1 is SIGKILLed after a random step in 2-4 and group 2 after one in 6-8; each is
    restarted once the others' quorum has dropped it and heals from a live group. All three end at max_steps with
    every rank's parameters and optimizer state bitwise equal."""
    rng = random.Random()
    die = {1: rng.randint(2, 4), 2: rng.randint(6, 8)}
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    steps = 16
    common = ["--data", str(shakespeare_tokens), "--out", str(out), "--steps", str(steps), "--sleep", "0.3"]
    common += ["--groups", "3"]
    with lighthouse(min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=1000) as address:
        env = {"TORCHFT_LIGHTHOUSE": address}
        live = {
            g: Group(
                f"g{g}", 2, [*common, "--group", str(g), *(["--die-at", str(die[g])] if g in die else [])], env, logs
            )
            for g in range(3)
        }
        for g in (1, 2):
            assert live[g].wait(180) == [-9, -9], f"die={die}\n{live[g].log()[-4000:]}"
            _wait_for(rf"Replica group 0: quorum \d+ at step \d+: groups \[[\d, ]*\] of 3; left: \[{g}\]", live[0], 60)
            live[g] = Group(f"g{g}b", 2, [*common, "--group", str(g)], env, logs)
            _wait_for(rf"Replica group {g}: quorum .* this group healed from a live group", live[g], 60)
        codes = {g: live[g].wait(180) for g in range(3)}
    assert codes == {0: [0, 0], 1: [0, 0], 2: [0, 0]}, f"die={die}\n" + "\n".join(live[g].log()[-2000:] for g in live)
    for rank in range(2):
        states = [_load(out, g, rank) for g in range(3)]
        assert all(s["global_step"] == steps for s in states)
        for name in states[0]["params"]:
            for other in states[1:]:
                assert torch.equal(states[0]["params"][name], other["params"][name]), (die, name)
                for key in states[0]["optim"][name]:
                    assert torch.equal(states[0]["optim"][name][key], other["optim"][name][key]), (die, name, key)


def test_one_rank_groups_equal_plain_fsdp(shakespeare_tokens, tmp_path):
    """Groups of one rank hold no FSDP2 unit (fp32 on one rank: nothing to shard), so their gradients are summed
    across the groups after the backward instead of by the units' hooks: 2 such groups train as one FSDP2 world of 2
    (the same sums in another order: losses within 1e-6, gradient norms and parameters as bounded below)."""
    plain, ft = tmp_path / "plain", tmp_path / "ft"
    plain.mkdir()
    ft.mkdir()
    base = ["--data", str(shakespeare_tokens), "--steps", "4"]
    proc = run_ranks(2, SCRIPT, [*base, "--out", str(plain)], {**os.environ, "OMP_NUM_THREADS": "1"}, 240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logs = tmp_path / "logs"
    logs.mkdir()
    with lighthouse(min_replicas=2) as address:
        env = {"TORCHFT_LIGHTHOUSE": address}
        groups = [Group(f"g{g}", 1, [*base, "--out", str(ft), "--group", str(g)], env, logs) for g in range(2)]
        codes = [g.wait(180) for g in groups]
    assert codes == [[0], [0]], "\n".join(g.log()[-3000:] for g in groups)
    full = {n: torch.cat([_load(plain, 0, r)["params"][n] for r in range(2)]) for n in _load(plain, 0, 0)["params"]}
    ref = _load(plain, 0, 0)
    for group in range(2):
        one = _load(ft, group, 0)
        assert one["losses"] == pytest.approx(ref["losses"], abs=1e-6)
        # The norm before clipping (Adam and clipping would hide a wrong gradient scale): 3.3M fp32 squares summed in
        # another split, pairwise (log2(n) * 2^-24 ~ 1.3e-6 relative), hence 1e-5.
        assert one["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
        for name, value in one["params"].items():
            # Adam moves an element whose gradient is near its eps by up to lr (3e-3) per step with that gradient's
            # last bits (one output-layer element here, 1.6e-6 after 4 steps): 1e-5, 300x below lr.
            torch.testing.assert_close(value, full[name], rtol=0, atol=1e-5, msg=name)
