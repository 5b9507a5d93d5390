"""``kforge estimate`` on the small recipes: bad input, JSON, the verdict's alternatives, the analytic fallback,
FLOP and collective counts against their formulas, the optimizer overlays, and a clean process afterwards.

Every estimate here simulates a 2-7M-parameter decoder in this process (a few seconds each); the cluster recipes
are estimated in tests/e2e/test_estimate_recipes.py and checked against gloo runs in
tests/distributed/test_estimate_vs_measured.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only

from kempnerforge.estimate import estimate, format_text
from kempnerforge.estimate.fake_ops import balanced_splits
from kempnerforge.estimate.report import gb
from tests.e2e.inprocess import kforge_in_process

REPO = Path(__file__).resolve().parents[2]
DEBUG = str(REPO / "configs" / "debug.yaml")
SHORT = ["--data.seq_len=64", "--data.micro_batch_size=2"]
#: The recipes' ``auto`` precision is simulated as on CUDA (bf16 compute); the fp32 formulas below pin float32.
FP32 = "--trainer.strategy.init_args.mixed_precision_param=float32"


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "args, field, message",
    [
        (["--trainer.strategy.init_args.tp=3"], "trainer.strategy.init_args.dp_shard", "world_size=4 is not divisible"),
        (["--trainer.strategy.init_args.tp=4"], "trainer.strategy.init_args.tp", "n_kv_heads=2"),
        (["--trainer.strategy.init_args.ep=2"], "trainer.strategy.init_args.ep", "ep=2 needs MoE layers"),
        (["--model.config.n_kv_heads=3"], "model.config.n_kv_heads", "ModelConfig.n_kv_heads=3 must divide n_heads=4"),
        (["--config", "configs/nope.yaml"], "--config", "configs/nope.yaml does not exist"),
        (["--json", "no_such_folder/est.json"], "--json", "the folder no_such_folder does not exist"),
        (["--json", "configs"], "--json", "is a folder"),
        (["--allowance.fragmentation", "1.5"], "--allowance.fragmentation=1.5", "a fraction in [0, 1)"),
        (["--allowance.nccl_channels", "0"], "--allowance.nccl_channels=0", "an integer >= 1"),
        (["--suggest", "tp,zoom"], "--suggest=tp,zoom", "zoom is not a knob; use activation_checkpointing,"),
        (["--gpu", "v100"], "argument --gpu", "invalid choice: 'v100'"),
    ],
    ids=["degrees-vs-world", "tp-vs-heads", "ep-dense", "bad-field-value", "missing-config", "json-folder", "json-dir",
         "fragmentation", "channels", "knob", "gpu-kind"],
)  # fmt: skip
def test_bad_input_is_one_line_before_anything_is_built(args, field, message, monkeypatch):
    """One line on stderr, the field first as under ``kforge fit`` (no Lightning start-up line, no progress line)."""
    import kempnerforge.estimate.run as run

    def never(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(run, "parallelize", never)
    proc = kforge_in_process("estimate", "--config", DEBUG, "--num_nodes", "1", "--devices_per_node", "4", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"kforge: error: {field}") and message in proc.stderr, proc.stderr
    assert not dist.is_initialized()


def test_unknown_field_and_missing_cluster_size_are_refused():
    proc = kforge_in_process("estimate", "--config", DEBUG, "--num_nodes", "1", "--devices_per_node", "1", "--foo=1")
    assert proc.returncode == 2 and "kforge: error: --foo: unknown option --foo=1" in proc.stderr
    proc = kforge_in_process("estimate", "--config", DEBUG, "--num_nodes", "1")
    assert proc.returncode == 2
    assert _last_line(proc.stderr) == "kforge: error: the following arguments are required: --devices_per_node"
    proc = kforge_in_process("estimate", "--config", DEBUG, "--num_nodes", "1", "--devices_per_node", "2",
                             "--trainer.devices=4")  # fmt: skip
    assert proc.returncode == 2 and "--trainer.devices: set by the estimate" in proc.stderr


def test_cli_report_json_and_a_clean_process_afterwards(tmp_path):
    """The report and its JSON, with the allowance's terms overridden from the command line (a100: 80 GB, its cuBLAS
    workspaces): each term as given, the NCCL one from the communicators the simulated rank's mesh created (dp_shard
    = the world here: one), which are the ones :func:`layout_communicators` counts for the same degrees."""
    from kempnerforge.estimate.allowance import NCCL_CONNECTION_BYTES, layout_communicators

    hook, rank = sys.excepthook, rank_zero_only.rank
    out = tmp_path / "est.json"
    args = ["--num_nodes", "1", "--devices_per_node", "2", "--json", str(out), *SHORT, "--gpu", "a100",
            "--allowance.cuda_context_gb", "1", "--allowance.fragmentation", "0.1", "--allowance.nccl_channels", "32"]  # fmt: skip
    proc = kforge_in_process("estimate", "--config", DEBUG, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[estimate] rank 0 of 2" in proc.stderr and "one training step" in proc.stderr  # progress lines
    assert "verdict: fits in 80.00 GB" in proc.stdout and "all_gather[dp_shard]" in proc.stdout
    assert "  allowance: CUDA context 1.00 GB (a100) + NCCL 616.6 MB (1 communicator: dp_shard 2;" in proc.stdout
    data = json.loads(out.read_text())
    assert data["verdict"]["fits"] and data["degrees"]["dp_shard"] == 2
    (role,) = data["roles"]
    assert role["peak_bytes"] > role["params_bytes"] > 0 and role["modules"]
    assert role["communicators"] == [{"axis": "dp_shard", "ranks": 2}]
    assert [c.__dict__ for c in layout_communicators(1, 1, 2, 1, 1, 1)] == role["communicators"]
    terms = {"cuda_context": 10**9, "nccl": 32 * 2 * NCCL_CONNECTION_BYTES, "workspaces": 2 * 8_519_680,
             "fragmentation": int(role["peak_bytes"] * 0.1)}  # fmt: skip
    assert data["verdict"]["allowance"] == terms
    assert data["verdict"]["needed_bytes"] == role["peak_bytes"] + sum(terms.values())
    # The fake world is gone and nothing of it leaks into what runs next in this process.
    assert not dist.is_initialized()
    assert sys.excepthook is hook and rank_zero_only.rank == rank
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1,))
        t = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        assert (t * 2).full_tensor().tolist() == [0.0, 2.0, 4.0, 6.0]  # no stale mesh from the fake world
    finally:
        dist.destroy_process_group()


#: The cluster recipe 7b_pp (pp=2 x pinned dp_shard=2, full AC) at the debug width, 1F1B over 2 blocks.
SMALL_7B_PP = ["--model.config.dim=128", "--model.config.n_heads=4",
               "--model.config.multiple_of=64", "--model.config.max_seq_len=64", "--data.seq_len=64",
               "--data.micro_batch_size=2", "--trainer.strategy.init_args.pp_microbatches=2",
               "--trainer.strategy.init_args.pp_virtual_stages=1", "--trainer.strategy.init_args.pp_schedule=1f1b",
               "--model.config.n_layers=2"]  # fmt: skip
#: Issue 27 check 2: recipe arguments, cluster, GPU memory (GB) below what the recipe needs, the knobs asked for,
#: the knobs the verdict prints, and whether one of them fits.
ADVICE = {
    "one-gpu-pinned-more-gpus": ([DEBUG, *SHORT, "--model.config.dim=1024", "--model.config.n_layers=2",
                                  "--trainer.strategy.init_args.dp_shard=1"], 1, 1, 2.1, "gpus", {"gpus"}, True),
    "7b_pp-pinned-tp": ([str(REPO / "configs" / "7b_pp.yaml"), *SMALL_7B_PP], 1, 4, 2.0, "tp", {"tp"}, True),
    "large-vocab-tp": ([DEBUG, "--model.config.dim=256", "--model.config.vocab_size=128256",
                        "--model.config.max_seq_len=1024", "--data.seq_len=1024", "--data.micro_batch_size=1",
                        "--model.config.n_layers=2", "--trainer.strategy.init_args.activation_checkpointing=full"],
                       1, 2, 1.95, "tp", {"tp"}, False),
    "pp_debug-micro-batch": ([str(REPO / "configs" / "pp_debug.yaml"), "--data.seq_len=64", "--data.micro_batch_size=4",
                              "--trainer.strategy.init_args.pp_microbatches=2"], 1, 2, 1.15, "micro_batch_size",
                             {"micro_batch_size"}, True),
    "cp_debug-cp": ([str(REPO / "configs" / "cp_debug.yaml"), *SHORT, "--model.config.n_layers=2"], 1, 4, 1.98, "cp",
                    {"cp"}, True),
    "moe-pp": ([str(REPO / "configs" / "moe_debug.yaml"), *SHORT, "--model.config.n_layers=2"], 1, 2, 1.10, "pp",
               {"pp"}, False),
    "dense-ac-loss": ([DEBUG, "--data.seq_len=256", "--data.micro_batch_size=4", "--model.config.n_layers=2",
                       "--model.loss_impl=torch", "--trainer.strategy.init_args.activation_checkpointing=selective_op"],
                      1, 1, 1.0, "activation_checkpointing,loss_impl",
                      {"activation_checkpointing", "loss_impl"}, True),
    "vlm-micro-batch": ([str(REPO / "configs" / "vlm_jd.yaml")], 1, 2, 1.06, "micro_batch_size",
                        {"micro_batch_size"}, True),
}  # fmt: skip


def _as_printed(change: str, nodes: int, devices: int) -> tuple[list[str], int, int]:
    """A suggestion's change split into fit overrides and the cluster (``--num_nodes N --devices_per_node D``)."""
    words = change.split()
    if words[:1] == ["--num_nodes"]:
        return words[4:], int(words[1]), int(words[3])
    return words, nodes, devices


def _preflight_accepts(args: list[str], nodes: int, devices: int) -> None:
    """``kforge fit``'s preflight layout checks (:func:`kempnerforge.preflight.check_layout`) on ``args`` at that
    cluster size: the degrees against the world, the model's and the data's parallel rules, the data's lengths."""
    from kempnerforge.estimate.build import parse
    from kempnerforge.estimate.run import simulation_args
    from kempnerforge.preflight import check_layout, check_loss_impl
    from kempnerforge.resilience.rendezvous import expected_world

    trainer, module, datamodule = parse(simulation_args(args, nodes, devices))
    world = expected_world(trainer.strategy)
    assert world.size == nodes * devices
    check_layout(trainer, module, datamodule, world)
    check_loss_impl(trainer, module)


@pytest.mark.parametrize("case", sorted(ADVICE))
def test_every_suggestion_rerun_as_printed_gives_its_peak_and_passes_preflight(case):
    """Issue 27 check 2: each printed suggestion, given back to the estimate as printed (cluster size and
    overrides), estimates the peak and the need it promised (5%; the simulation is deterministic, so they are
    equal), fits or not as it said, and passes ``kforge fit``'s preflight layout checks at that size. A pinned
    ``dp_shard`` moves with the world (more GPUs) or gives ranks to tp; tp > 1 on a 128k vocabulary switches
    ``loss_impl=auto`` from the fused head + loss to full local logits, so its peak is above the run's and says so."""
    recipe, nodes, devices, memory, knobs, expected, one_fits = ADVICE[case]
    args = ["--config", recipe[0], *recipe[1:]]
    est = estimate(args, nodes, devices, gpu_memory_gb=memory, knobs=knobs.split(","))
    assert not est.verdict.fits
    suggestions = est.verdict.suggestions
    assert {s.knob for s in suggestions} == expected, est.verdict
    text = format_text(est)
    peak = max(r.peak_bytes for r in est.roles)
    for s in suggestions:
        assert s.how == "estimated" and f"{s.change} -> peak {gb(s.peak_bytes)}, needs {gb(s.needed_bytes)}" in text
        overrides, n, d = _as_printed(s.change, nodes, devices)
        _preflight_accepts([*args, *overrides], n, d)
        again = estimate([*args, *overrides], n, d, gpu_memory_gb=memory, alternatives=False)
        assert max(r.peak_bytes for r in again.roles) == pytest.approx(s.peak_bytes, rel=0.05)
        assert again.verdict.needed_bytes == pytest.approx(s.needed_bytes, rel=0.05)
        assert again.verdict.fits == s.fits
        if "pinned" in case:  # pinned in the recipe: every suggestion moves it
            assert "--trainer.strategy.init_args.dp_shard=" in s.change, s.change
        if s.knob == "tp" and case == "large-vocab-tp":  # full local logits at tp = 2, as the estimate how-to quotes
            assert s.peak_bytes > peak and not s.fits
            readme = " ".join((REPO / "docs" / "how-to" / "estimate.md").read_text().split())
            assert f"(full AC; peak {gb(peak)}) gets `tp=2` at peak {gb(s.peak_bytes)}," in readme
    assert any(s.fits for s in suggestions) == one_fits
    data = json.loads(json.dumps(est.to_json()))
    assert [(s["knob"], s["how"], s["peak_bytes"]) for s in data["verdict"]["suggestions"]] == [
        (s.knob, "estimated", s.peak_bytes) for s in suggestions
    ]


def test_allowance_counts_nccl_buffers_per_communicator_the_mesh_creates():
    """The NCCL term in closed form: channels x connections x (4 MiB Simple + 4,915,200 B LL128 + 512 KiB LL) per
    communicator of more than one rank; a ring has 2 connections, ep's all-to-all 2 per other rank."""
    from kempnerforge.estimate.allowance import NCCL_CONNECTION_BYTES, Allowance, layout_communicators

    assert NCCL_CONNECTION_BYTES == 4 * 2**20 + 4_915_200 + 2**19
    tp = layout_communicators(1, 1, 2, 1, 2, 1)  # 4 ranks as dp_shard=2 x tp=2: the flattened dp group is its own
    assert sorted((c.axis, c.ranks) for c in tp) == [("dp", 2), ("dp_shard", 2), ("tp", 2), ("world", 4)]
    assert Allowance.for_gpu().nccl_bytes(list(tp)) == 4 * 16 * 2 * NCCL_CONNECTION_BYTES
    (ep,) = layout_communicators(1, 1, 4, 1, 1, 4)  # ep=4 over dp_shard=4 = the world: one communicator
    assert (ep.axis, ep.ranks, ep.connections) == ("ep", 4, 6)
    terms = Allowance.for_gpu("h200", nccl_channels=32).terms(10**9, [ep])
    assert terms == {"cuda_context": 600_000_000, "nccl": 32 * 6 * NCCL_CONNECTION_BYTES,
                     "workspaces": 2 * 32 * 2**20, "fragmentation": 50_000_000}  # fmt: skip
    assert layout_communicators(1, 1, 1, 1, 1, 1) == ()  # one rank: no communicator


def test_does_not_fit_exits_3_without_suggestions():
    proc = kforge_in_process("estimate", "--config", DEBUG, "--num_nodes", "1", "--devices_per_node", "1",
                             "--gpu_memory_gb", "0.5", "--no_alternatives", *SHORT)  # fmt: skip
    assert proc.returncode == 3 and "verdict: does not fit" in proc.stdout and "  - " not in proc.stdout


def test_flops_and_collectives_match_their_formulas():
    """Dense decoder without AC: executed FLOPs are the PaLM count (``flops_per_token``) plus the fifth matmul of the
    flash-attention backward (2 * n_layers * dim * seq per token), which the 6N + 12 L d s convention leaves out.
    FSDP2 at dp_shard=2 (fp32): parameters gathered for forward and again for backward except the last block, and
    every gradient reduce-scattered once."""
    overrides = ["--model.config.tie_embeddings=false", *SHORT, FP32]
    est = estimate(["--config", DEBUG, *overrides, "--model.loss_impl=torch"], 1, 2, alternatives=False)
    (role,) = est.roles
    from kempnerforge.config import ModelConfig

    cfg = ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=50257, max_seq_len=256, multiple_of=64)
    seq, tokens = 64, 2 * 64
    palm = cfg.flops_per_token(seq) * tokens
    norms = 6 * (2 * cfg.n_layers + 1) * cfg.dim * tokens  # norm weights are in N but no matmul
    assert role.flops == pytest.approx(palm - norms + 2 * cfg.n_layers * cfg.dim * seq * tokens, rel=1e-6)
    total = est.model_params * 4
    last_block = (total - 2 * cfg.vocab_size * cfg.dim * 4 - cfg.dim * 4) / cfg.n_layers
    # The fused head + loss (chunks of 32 tokens) runs the same three head matmuls (one of them an in-place addmm_).
    chunked = estimate(["--config", DEBUG, *overrides, "--model.loss_chunk_size=32"], 1, 2, alternatives=False)
    assert chunked.roles[0].flops == pytest.approx(role.flops, rel=1e-6)
    assert role.comm["reduce_scatter[dp_shard]"] == pytest.approx(total, rel=1e-3)
    assert role.comm["all_gather[dp_shard]"] == pytest.approx(2 * total - last_block, rel=1e-3)
    # tp=2 (one data shard of 2 sequences, the heads and the vocab split in two): half of the FLOPs of those 2
    # sequences, which the dp_shard=2 rank above runs whole, plus rank 0's half vocab row more (50257 is odd: its
    # head shard has 25129 rows) in the head's three matmuls. DTensor's global-shape fake run of each new op
    # schema (its output-shape propagation) is not counted: it once added a full-vocab head per step.
    tp = estimate(["--config", DEBUG, *overrides, "--trainer.strategy.init_args.tp=2"], 1, 2, alternatives=False)
    odd_row = 3 * 2 * tokens * cfg.dim * 0.5
    assert tp.roles[0].flops == pytest.approx(role.flops / 2 + odd_row, rel=1e-9)


def test_z_loss_at_tp2_reduces_the_vocab_shards_instead_of_gathering_the_logits():
    """z-loss at tp=2 (loss parallel, bf16 logits): no ``all_gather[tp]`` (before: the full fp32 logits, 128 tokens x
    50,257 x 4 B = 25.7 MB, and a 32 MB higher peak), two all-reduces of one fp32 per token (row max, sum of exp),
    and a peak higher only by the local bf16 logits shard its backward keeps (128 x 25,129 x 2 B)."""
    args = ["--config", DEBUG, *SHORT, "--trainer.strategy.init_args.tp=2"]
    plain = estimate(args, 1, 2, alternatives=False).roles[0]
    z = estimate([*args, "--model.z_loss_weight=1e-4"], 1, 2, alternatives=False).roles[0]
    tokens, shard_rows = 2 * 64, (50257 + 1) // 2
    assert z.comm.get("all_gather[tp]", 0) == plain.comm.get("all_gather[tp]", 0) == 0
    assert z.comm["all_reduce[tp]"] - plain.comm["all_reduce[tp]"] == 2 * tokens * 4
    assert z.comm_calls["all_reduce[tp]"] - plain.comm_calls["all_reduce[tp]"] == 2
    assert 0 < z.peak_bytes - plain.peak_bytes <= tokens * shard_rows * 2


def test_moe_capacity_runs_on_fake_tensors_without_fallback():
    """moe_debug's capacity dropping keeps fixed shapes (masked rows, no boolean indexing): nothing falls back."""
    est = estimate(["--config", str(REPO / "configs" / "moe_debug.yaml"), *SHORT], 1, 1, alternatives=False)
    (role,) = est.roles
    assert role.fallbacks == []
    assert role.grads_bytes == pytest.approx(role.params_bytes, rel=0.01)


def test_moe_with_tp_and_ep_is_estimated_and_shards_every_parameter():
    """MoE with tp=2 x ep=2 on 4 simulated ranks (dp_shard=2, expert-TP): accepted, nothing falls back, each rank
    holds a quarter of the parameters (dense ones over tp x dp_shard, experts over (ep, tp)) and the MoE
    layer's TP reduction shows up as a tp all-reduce next to the ep all-to-all."""
    args = ["--config", str(REPO / "configs" / "moe_debug.yaml"), *SHORT, "--trainer.strategy.init_args.tp=2",
            "--trainer.strategy.init_args.ep=2"]  # fmt: skip
    est = estimate(args, 1, 4, alternatives=False)
    (role,) = est.roles
    assert role.fallbacks == []
    assert role.params_bytes == pytest.approx(role.params_global_bytes / 4, rel=0.01)
    assert role.comm["all_reduce[tp]"] > 0 and role.comm["all_to_all[ep]"] > 0


def test_analytic_fallback_names_the_module_and_counts_it(monkeypatch):
    """An MoE layer that indexes by a data-dependent mask (as moe_debug's capacity did before it kept fixed
    shapes; no fake kernel can size it) is counted analytically, named, and the rest of the step runs."""
    from kempnerforge.model.moe import MoE

    real_forward = MoE.forward

    def data_dependent(self, x, *args, **kwargs):
        x = x + 0 * x[x > 0].sum()  # boolean indexing: output shape depends on the values
        return real_forward(self, x, *args, **kwargs)

    monkeypatch.setattr(MoE, "forward", data_dependent)
    est = estimate(["--config", str(REPO / "configs" / "moe_debug.yaml"), *SHORT], 1, 1, alternatives=False)
    (role,) = est.roles
    names = {f["module"] for f in role.fallbacks}
    assert names == {"layers.1.moe", "layers.3.moe"}
    for f in role.fallbacks:
        assert "DynamicOutputShapeException" in f["reason"]
        assert f["flops"] > 0 and f["activation_bytes"] > 0 and f["calls"] == 1
    assert role.flops > sum(f["flops"] for f in role.fallbacks) > 0
    assert role.grads_bytes == pytest.approx(role.params_bytes, rel=0.01)  # the experts still get gradients
    from kempnerforge.estimate import format_text

    assert "analytic fallback: layers.1.moe could not run on fake tensors" in format_text(est)


def test_balanced_splits():
    x = torch.empty(10, 4)
    assert balanced_splits(x, 4) == ([3, 3, 2, 2], [3, 3, 2, 2])


#: configs/recipes overlays (optimizer + schedule) -> optimizer-state bytes per parameter byte (on debug).
OVERLAYS = {
    "adamw_cosine": (2.0, 2.0),  # exp_avg, exp_avg_sq
    "adamw_linear": (2.0, 2.0),
    "adamw_none": (2.0, 2.0),
    "lion_rex": (1.0, 1.0),  # exp_avg
    "muon_wsd": (1.0, 2.0),  # momentum on hidden matrices, AdamW moments on the rest
    "schedule_free_constant": (2.0, 2.0),  # z, exp_avg_sq
}


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_optimizer_overlay_is_estimated(overlay):
    path = REPO / "configs" / "recipes" / f"{overlay}.yaml"
    est = estimate(["--config", DEBUG, "--config", str(path), *SHORT], 1, 2, alternatives=False)
    (role,) = est.roles
    low, high = OVERLAYS[overlay]
    ratio = role.optimizer_bytes / role.params_bytes
    assert low - 0.01 <= ratio <= high + 0.01, ratio
    assert est.verdict.fits and role.peak_bytes > role.params_bytes + role.optimizer_bytes


def test_a_step_outside_the_fallback_is_named_not_crashed(monkeypatch):
    """A data-dependent op outside the blocks (here injected into the model's document mask) ends the estimate
    with one line naming the code, exit status 1, and a torn-down fake world."""
    import kempnerforge.model.transformer as transformer

    real = transformer.document_attention_mask

    def data_dependent_mask(doc_ids):
        doc_ids.nonzero()  # an output shape only values decide
        return real(doc_ids)

    monkeypatch.setattr(transformer, "document_attention_mask", data_dependent_mask)
    proc = kforge_in_process("estimate", "--config", DEBUG, "--num_nodes", "1", "--devices_per_node", "1",
                             "--data.document_masking=true", *SHORT)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = _last_line(proc.stderr)
    assert last.startswith("kforge: error: cannot simulate the step on fake tensors: FSDPTransformer.forward ("), last
    assert "kempnerforge/model/transformer.py:" in last and "nonzero" in last
    assert not dist.is_initialized()


def test_video_vlm_is_estimated_with_full_clips():
    est = estimate(["--config", str(REPO / "configs" / "vlm_video.yaml")], 1, 1, alternatives=False)
    (role,) = est.roles
    assert est.verdict.fits and role.flops > 0 and not role.fallbacks


def test_joint_decoder_vlm_with_pp_and_sequence_parallel_is_estimated():
    """vlm_jd at 1 x 4 with pp=2 x tp=2 and sequence parallelism: the first stage holds the vision tower, the last
    the head (untied: tp > 1 with a tied pipeline is refused); each stage passes this rank's half of the joint [16 visual; 48 text]
    sequence, once forward and once backward, for the micro-batch of 4 (bf16: auto precision as on CUDA; dim 64)."""
    args = ["--config", str(REPO / "configs" / "vlm_jd.yaml"), "--trainer.strategy.init_args.pp=2",
            "--trainer.strategy.init_args.tp=2", "--trainer.strategy.init_args.sequence_parallel=true",
            "--model.config.tie_embeddings=false"]  # fmt: skip
    est = estimate(args, 1, 4, alternatives=False)
    first, last = est.roles
    assert first.comm["send_recv[pp]"] == last.comm["send_recv[pp]"] == 2 * 4 * (16 + 48) // 2 * 64 * 2
    assert first.params_bytes > last.params_bytes  # the vision tower is on the first stage
    assert est.verdict.fits and all(not role.fallbacks for role in est.roles)


def test_ep_with_hsdp_holds_half_of_every_weight_and_all_reduces_over_dp_replicate():
    """moe_debug at 1 x 4 with ep=2 x dp_replicate=2 (dp_shard=2, one expert-FSDP shard): dense weights are 1/2
    per rank (dp_shard=2), experts 1/2 too (ep=2, replicated over dp_replicate), so a rank holds half the fp32
    model; every gradient shard is all-reduced over dp_replicate once, experts are not reduce-scattered (nothing
    left to shard them over), and tokens travel over ep."""
    args = ["--config", str(REPO / "configs" / "moe_debug.yaml"), *SHORT]
    lines: list[str] = []
    est = estimate([*args, "--trainer.strategy.init_args.ep=2", "--trainer.strategy.init_args.dp_replicate=2"], 1, 4,
                   alternatives=False, progress=lines.append)  # fmt: skip
    assert "EP=2 -> FSDP2 over dp_replicate=2 x dp_shard=2 (experts over dp_replicate=2 x dp_shard/ep=1)" in str(lines)
    (role,) = est.roles
    assert role.params_bytes == pytest.approx(est.model_params * 4 / 2, rel=1e-3)
    assert role.comm["all_reduce[dp_replicate]"] == pytest.approx(role.grads_bytes, rel=1e-3)
    assert role.comm["all_to_all[ep]"] > 0 and not any("dp_shard/ep" in k for k in role.comm)


def test_cp_with_ep_and_with_pp_is_estimated_on_the_axes_it_runs_on():
    """moe_debug at 1 x 4 with cp=2 x ep=2 (dp_shard=2): dense weights shard over dp_shard x cp = 4 and ep borrows
    from that axis, so experts are FSDP-sharded over its other 2 ranks; cp_debug with pp=2 (1 x 4: cp=2 per
    stage): a stage sends and receives this rank's half of each sequence, once forward and once backward."""
    lines: list[str] = []
    moe = ["--config", str(REPO / "configs" / "moe_debug.yaml"), *SHORT, "--trainer.strategy.init_args.cp=2",
           "--trainer.strategy.init_args.ep=2"]  # fmt: skip
    est = estimate(moe, 1, 4, alternatives=False, progress=lines.append)
    assert "EP=2 -> FSDP2 over dp_shard_cp=4 (experts over dp_shard_cp/ep=2)" in str(lines)
    (role,) = est.roles
    assert role.params_bytes == pytest.approx(est.model_params * 4 / 4, rel=1e-3)  # fp32, 1/4 of every weight
    for axis in ("all_to_all[ep]", "all_gather[cp]", "reduce_scatter[dp_shard_cp]", "reduce_scatter[dp_shard_cp/ep]"):
        assert role.comm[axis] > 0, (axis, role.comm)
    pp = ["--config", str(REPO / "configs" / "cp_debug.yaml"), *SHORT, "--trainer.strategy.init_args.pp=2"]
    est = estimate(pp, 1, 4, alternatives=False)
    first = est.roles[0]
    dim = 128  # cp_debug's decoder; bf16 activations (auto precision as on CUDA)
    assert first.comm["send_recv[pp]"] == 2 * 2 * (64 // 2) * dim * 2  # micro-batch 2, 32 of 64 tokens, fwd + bwd
    assert est.verdict.fits and all(not role.fallbacks for role in est.roles)


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_recipe_resolves_auto_precision_as_the_gpus_do(recipe):
    """Issue 27 check 1: the estimate sets the strategy's target device to CUDA, so a recipe whose
    ``mixed_precision_param`` is ``auto`` is simulated in bf16 compute (as ``kforge fit`` runs it on GPUs), and an
    explicit ``float32`` stays fp32; the note names the substitution."""
    from kempnerforge.estimate.build import parse, substitutions
    from kempnerforge.estimate.run import simulation_args

    path = REPO / "configs" / recipe
    # Fine-tuning recipes name an HF folder this machine does not have; precision does not depend on it.
    start = ["--model.init_from=null"] if "\n  init_from:" in path.read_text() else []
    if recipe == "finetune_debug.yaml":  # its data's tokenizer is the folder's too
        start.append(f"--data.tokenizer={REPO / 'data' / 'tokenizers' / 'gpt2'}")
    trainer, _, datamodule = parse(simulation_args(["--config", str(path), *start], 1, 1))
    strategy = trainer.strategy
    strategy.target_device_type = "cuda"
    auto = strategy.mixed_precision_param == "auto" and strategy.true_half is None
    expected = torch.bfloat16 if auto or strategy.mixed_precision_param == "bfloat16" else torch.float32
    assert strategy.param_dtype == (strategy.true_half or expected)
    notes = substitutions(strategy, datamodule)
    assert any(n.startswith("mixed_precision_param=auto resolved as on CUDA: bf16 compute") for n in notes) == auto


def test_auto_precision_halves_moe_debugs_all_gather_and_liger_is_one_line():
    """Issue 27 checks 1 and 3: moe_debug at 1 x 2 gathers bf16 parameters under ``auto`` (the GPU run), exactly
    half the bytes of ``float32``; ``loss_impl=liger`` (Triton kernels) is refused in one line."""
    args = ["--config", str(REPO / "configs" / "moe_debug.yaml")]
    auto = estimate(args, 1, 2, alternatives=False)
    fp32 = estimate([*args, "--trainer.strategy.init_args.mixed_precision_param=float32"], 1, 2, alternatives=False)
    gathered = auto.roles[0].comm["all_gather[dp_shard]"]
    assert gathered > 0 and gathered * 2 == fp32.roles[0].comm["all_gather[dp_shard]"]
    assert any("auto resolved as on CUDA" in n for n in auto.notes) and not fp32.notes
    proc = kforge_in_process("estimate", *args, "--model.loss_impl=liger", "--num_nodes", "1",
                             "--devices_per_node", "2")  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("kforge: error: model.loss_impl: liger runs Triton kernels"), proc.stderr


def test_pipeline_with_tied_embeddings_counts_the_embedding_gradient_all_reduce():
    """Issue 27 check 4: pp_debug tied at 1 x 2: both stages all-reduce their copy of the embedding's gradient over
    the first/last-stage pair (the pp group at pp=2), vocab x dim fp32 (the sharded run's gradients stay fp32),
    on top of the scalars (loss, gradient norm) the untied run reduces too."""
    args = ["--config", str(REPO / "configs" / "pp_debug.yaml")]
    tied = estimate([*args, "--model.config.tie_embeddings=true"], 1, 2, alternatives=False)
    untied = estimate(args, 1, 2, alternatives=False)
    embedding_grad = 50257 * 128 * 4
    for with_tie, without in zip(tied.roles, untied.roles, strict=True):
        # within 1 kB: the gradient norm's scalars differ with the tied copy left out of it (norm_skip)
        assert with_tie.comm["all_reduce[pp]"] - without.comm["all_reduce[pp]"] == pytest.approx(
            embedding_grad, abs=1024
        )
        assert without.comm["all_reduce[pp]"] < 1024


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchft") is None, reason="torchft not installed")
def test_fault_tolerance_estimates_one_replica_group_unchanged():
    """Issue 31: a config with ``fault_tolerance`` is estimated as the one group it describes (no lighthouse is
    contacted): every rank's peak and the verdict equal the same config without it."""
    ft = ["--trainer.strategy.init_args.fault_tolerance.replica_group_id=1",
          "--trainer.strategy.init_args.fault_tolerance.num_replica_groups=4",
          "--trainer.strategy.init_args.fault_tolerance.lighthouse=http://localhost:1"]  # fmt: skip
    plain = estimate(["--config", DEBUG, *SHORT], 1, 2, alternatives=False)
    with_ft = estimate(["--config", DEBUG, *SHORT, *ft], 1, 2, alternatives=False)
    assert [r.peak_bytes for r in with_ft.roles] == [r.peak_bytes for r in plain.roles]
    assert with_ft.verdict.fits == plain.verdict.fits
