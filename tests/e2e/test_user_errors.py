"""Issue 18, checks 2, 3 and 8: bad input is one line before anything waits; a short world times out saying so;
``kforge --help`` lists every command without importing torch.

Check 2 runs ``kempnerforge.cli.main`` in-process (tests/e2e/inprocess.py; Lightning's log lines are captured
there too) with the calls that would start something replaced by recorders: ``Trainer.fit`` (the launcher),
``torch.distributed.init_process_group`` and ``TCPStore`` (a process group or rendezvous) and the modules'
``configure_model`` (a model). One real ``kforge`` process proves the single stderr line where in-process
cannot (everything the interpreter and Lightning print on their own).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from safetensors.torch import save_file

from kempnerforge.checkpoint.dcp_io import DCPCheckpointIO
from kempnerforge.checkpoint.disk import format_bytes
from kempnerforge.commands import LIGHTNING_COMMANDS, TOOLS
from kempnerforge.config import ModelConfig
from kempnerforge.module import CausalLM, VisionLanguage
from tests.e2e.inprocess import REPO, kforge_in_process
from tests.procs import run_group

#: Flags every case adds: nothing may be written into the repository by a case that (wrongly) got further.
QUIET = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.max_steps=2"]


def _recipe(name: str, tmp: Path) -> list[str]:
    return ["fit", "--config", f"configs/{name}.yaml", *QUIET, f"--trainer.default_root_dir={tmp}",
            f"--trainer.callbacks.init_args.dirpath={tmp / 'ckpt'}"]  # fmt: skip


@pytest.fixture
def started(monkeypatch) -> list[str]:
    """Records whatever would start: a launch (Trainer.fit), a rendezvous or process group, a model."""
    calls: list[str] = []

    def replace(owner, attr: str) -> None:
        name = f"{getattr(owner, '__name__', owner)}.{attr}"

        @functools.wraps(getattr(owner, attr))  # LightningCLI reads Trainer.fit's signature for its arguments
        def record(*args, **kwargs):
            calls.append(name)
            raise RuntimeError(f"{name} was called")

        monkeypatch.setattr(owner, attr, record)

    replace(Trainer, "fit")
    replace(dist, "init_process_group")
    replace(dist, "TCPStore")
    replace(CausalLM, "configure_model")
    replace(VisionLanguage, "configure_model")
    return calls


@pytest.fixture
def bad_files(tmp_path) -> dict[str, Path]:
    """An empty folder, a regular file, a .partial save and a complete checkpoint whose meta.pt is truncated."""
    empty = tmp_path / "empty"
    empty.mkdir()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    partial = tmp_path / "saves" / "step=000002.ckpt.partial"
    partial.mkdir(parents=True)
    good = tmp_path / "saves" / "step=000004.ckpt"
    DCPCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(8)}, "lr_schedulers": []}, good)
    meta = good / "meta.pt"
    meta.write_bytes(meta.read_bytes()[:20])
    tokens = tmp_path / "tokens"  # a token folder whose metadata.json was cut short
    tokens.mkdir()
    (tokens / "metadata.json").write_text('{"shards": [')
    # Hugging Face folders for model.init_from: a config.json without weights, and an architecture we do not load.
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip
    hf_config_only = tmp_path / "hf_config_only"
    hf_config_only.mkdir()
    (hf_config_only / "config.json").write_text(json.dumps(llama))
    hf_no_tokenizer = tmp_path / "hf_no_tokenizer"  # weights present (an empty file is enough: never opened)
    hf_no_tokenizer.mkdir()
    (hf_no_tokenizer / "config.json").write_text(json.dumps(llama))
    (hf_no_tokenizer / "model.safetensors").write_bytes(b"")
    hf_truncated = tmp_path / "hf_truncated"  # tokenizer present, weights cut short: found by preflight on rank 0
    hf_truncated.mkdir()
    (hf_truncated / "config.json").write_text(json.dumps(llama))
    (hf_truncated / "tokenizer_config.json").write_text("{}")
    save_file({"model.norm.weight": torch.ones(64)}, str(hf_truncated / "model.safetensors"))
    (hf_truncated / "model.safetensors").write_bytes((hf_truncated / "model.safetensors").read_bytes()[:-8])
    hf_gpt2 = tmp_path / "hf_gpt2"
    hf_gpt2.mkdir()
    (hf_gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    hf_mtp = tmp_path / "hf_mtp"  # DeepSeek-V3 with a multi-token-prediction layer on disk (only its header is read)
    hf_mtp.mkdir()
    from transformers import DeepseekV3Config

    from tests.deepseek_tiny import HF_KW

    DeepseekV3Config(**HF_KW, architectures=["DeepseekV3ForCausalLM"]).save_pretrained(hf_mtp)
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(2, 2)}, str(hf_mtp / "model.safetensors"))
    (hf_mtp / "tokenizer.json").write_text("{}")
    return {"empty": empty, "blocker": blocker, "partial": partial, "corrupt": good, "tokens": tokens,
            "hf_config_only": hf_config_only, "hf_gpt2": hf_gpt2, "hf_no_tokenizer": hf_no_tokenizer,
            "hf_mtp": hf_mtp, "hf_truncated": hf_truncated}  # fmt: skip


# (recipe, extra arguments, substrings the one line must hold: the field, and the file or value)
CASES = {
    # config values and options
    "n_heads": ("debug", ["--model.config.n_heads=3"], ["model.config.", "n_heads=3"]),
    "abbreviation": ("debug", ["--model.config.n_layer=2"], ["--model.config.n_layer", "unknown option"]),
    "type": ("debug", ["--model.config.n_heads=abc"], ["model.config.n_heads:", "abc"]),
    "unknown_option": ("debug", ["--model.config.bogus=1"], ["--model.config.bogus:"]),
    "optimizer": ("debug", ["--model.optimizer.name=sgdx"], ["model.optimizer.name:", "sgdx"]),
    "decay": ("debug", ["--model.scheduler.decay=sometimes"], ["model.scheduler.decay:", "sometimes"]),
    "config_file": (None, ["fit", "--config", "configs/nope.yaml"], ["--config:", "configs/nope.yaml"]),
    "moe_top_k": ("moe_debug", ["--model.config.top_k=16"], ["model.config.top_k:", "num_experts=8"]),
    "vlm_arch": ("vlm_jd", ["--model.init_args.vlm.arch=llava9"], ["vlm.arch", "llava9"]),
    "vlm_connector": ("vlm_jd", ["--model.init_args.connector.type=qformer"], ["connector.type", "qformer"]),
    "video_fps": ("vlm_video", ["--data.init_args.fps=0"], ["data.fps:", "fps=0.0"]),
    # paths
    "tokenizer": (
        "debug",
        ["--data.data_dir={empty}", "--data.tokenizer=/nonexistent/tok"],
        ["data.tokenizer:", "/nonexistent/tok"],
    ),  # fmt: skip
    "data_dir": (
        "debug",
        ["--data.data_dir={empty}", "--data.source=null", "--data.tokenizer=null"],
        ["data.data_dir:", "metadata.json"],
    ),  # fmt: skip
    "data_dir_metadata": (
        "debug",
        ["--data.data_dir={tokens}", "--data.source=null", "--data.tokenizer=null"],
        ["data.data_dir:", "metadata.json", "is not valid JSON"],
    ),  # fmt: skip
    "source_without_tokenizer": ("debug", ["--data.tokenizer=null"], ["data.tokenizer:", "go together"]),
    "micro_batch_size": ("debug", ["--data.micro_batch_size=0"], ["data.micro_batch_size:", "got 0"]),
    "val_fraction": ("debug", ["--data.val_fraction=1.0"], ["data.val_fraction:", "[0, 1)"]),
    "source": (
        "debug",
        ["--data.data_dir={empty}", "--data.source=/nonexistent/corpus.txt"],
        ["data.source:", "/nonexistent/corpus.txt"],
    ),  # fmt: skip
    "encoder": (
        "vlm_jd",
        ["--model.init_args.encoder.pretrained_path=/nonexistent/siglip"],
        ["model.encoder.pretrained_path:", "/nonexistent/siglip"],
    ),  # fmt: skip
    "vlm_source": ("vlm_jd", ["--data.init_args.source=/nonexistent/captions.jsonl"], ["data.source:", "captions"]),
    "video_source": ("vlm_video", ["--data.init_args.source=/nonexistent/results.csv"], ["data.source:", "results"]),
    "video_tokenizer": ("vlm_video", ["--data.init_args.tokenizer=/nonexistent/tok"], ["data.tokenizer:"]),
    "7b_on_one_machine": ("vlm_7b_siglip2", [], ["model.encoder.pretrained_path:", "siglip2-so400m"]),
    # fine-tuning from a Hugging Face folder (model.init_from)
    "init_from_missing": (
        "finetune_debug",
        ["--model.init_from={empty}/nope"],
        ["model.init_from:", "empty/nope is not a directory"],
    ),  # fmt: skip
    "init_from_no_config": ("finetune_debug", ["--model.init_from={empty}"], ["model.init_from:", "no config.json"]),
    "init_from_arch": (
        "finetune_debug",
        ["--model.init_from={hf_gpt2}"],
        ["model.init_from:", "GPT2LMHeadModel", "allowed: 'deepseek_v3', 'llama'"],
    ),  # fmt: skip
    "init_from_no_weights": (
        "finetune_debug",
        ["--model.init_from={hf_config_only}"],
        ["model.init_from:", "no .safetensors weights"],
    ),  # fmt: skip
    "init_from_no_tokenizer": (
        "finetune_debug",
        ["--model.init_from={hf_no_tokenizer}", "--data.data_dir={empty}/tokens"],
        ["data.tokenizer:", "hf_no_tokenizer (model.init_from) holds no tokenizer files"],
    ),  # fmt: skip
    "init_from_mtp": (
        "finetune_debug",
        ["--model.init_from={hf_mtp}"],
        ["model.init_from:", "num_nextn_predict_layers", "multi-token-prediction layers [3]"],
    ),  # fmt: skip
    "init_from_truncated_weights": (
        "finetune_debug",
        ["--model.init_from={hf_truncated}", "--data.data_dir={empty}/tokens"],
        ["model.init_from:", "hf_truncated: the safetensors weights cannot be opened", "not fully covered"],
    ),  # fmt: skip
    "init_from_conflict": (
        "finetune_debug",
        ["--model.init_from={hf_config_only}", "--model.config.n_layers=3"],
        ["model.config.n_layers:", "3 conflicts with", "gives 2"],
    ),  # fmt: skip
    # mesh, before any process starts (devices=4 would launch 3 more ranks)
    "tp_vs_world": (
        "debug",
        ["--trainer.strategy.init_args.tp=3"],
        ["trainer.strategy.init_args.dp_shard:", "cp*tp = 1*1*1*3", "world size 1 comes from trainer.num_nodes=1"],
    ),  # fmt: skip
    "dp_shard": ("debug", ["--trainer.strategy.init_args.dp_shard=3"], ["dp_shard", "trainer.devices=1"]),
    "ep_dense": ("debug", ["--trainer.strategy.init_args.ep=2"], ["trainer.strategy.init_args.ep:"]),
    "tp_vs_kv_heads": ("debug", ["--trainer.devices=4", "--trainer.strategy.init_args.tp=4"], ["tp", "n_kv_heads"]),
    "moe_ep": ("moe_debug", ["--trainer.devices=2", "--trainer.strategy.init_args.ep=3"], ["ep=3"]),
    "vlm_sequence_parallel": (
        "vlm_jd",
        [
            "--model.init_args.vlm.arch=mot",  # joint_decoder takes sequence parallelism; the other archs refuse it
            "--trainer.devices=2",
            "--trainer.strategy.init_args.tp=2",
            "--trainer.strategy.init_args.sequence_parallel=true",
        ],
        ["sequence_parallel"],
    ),  # fmt: skip
    "fp8_sequence_parallel_on_gloo": (
        "debug",
        [
            "--trainer.devices=2",
            "--trainer.strategy.init_args.tp=2",
            "--trainer.strategy.init_args.sequence_parallel=true",
            "--trainer.strategy.init_args.float8_recipe=tensorwise",
        ],
        ["float8_recipe", "gloo cannot all-gather float8"],
    ),  # fmt: skip
    # data against the model
    "seq_len": ("debug", ["--data.seq_len=512"], ["data.seq_len:", "max_seq_len=256"]),
    "vlm_text_len": ("vlm_jd", ["--data.init_args.max_text_len=100"], ["model.config.max_seq_len:", "116"]),
    "video_frames": ("vlm_video", ["--data.init_args.max_frames=10"], ["model.config.max_seq_len:", "max_frames=10"]),
    # checkpoints
    "ckpt_missing": ("debug", ["--ckpt_path=/nonexistent/ckpt"], ["ckpt_path:", "/nonexistent/ckpt"]),
    "ckpt_partial": ("debug", ["--ckpt_path={partial}"], ["ckpt_path:", "partial checkpoint"]),
    "ckpt_corrupt": ("debug", ["--ckpt_path={corrupt}"], ["ckpt_path:", "meta.pt", "corrupt"]),
    "ckpt_not_writable": (
        "debug",
        ["--trainer.callbacks.init_args.dirpath={blocker}/ckpt"],
        ["ModelCheckpoint.dirpath:", "a_file/ckpt", "not writable"],
    ),  # fmt: skip
    "vlm_ckpt_not_writable": (
        "vlm_jd",
        ["--trainer.callbacks.init_args.dirpath={blocker}/ckpt"],
        ["ModelCheckpoint.dirpath:", "not writable"],
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_before_anything_starts(case, tmp_path, bad_files, started):
    recipe, extra, expected = CASES[case]
    extra = [a.format(**bad_files) for a in extra]
    args = extra if recipe is None else [*_recipe(recipe, tmp_path), *extra]
    proc = kforge_in_process(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("kforge: error: "), lines
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert started == [], f"{started} ran before the refusal"


TOOL_CASES = {
    "generate_missing": (["generate", "--ckpt", "/nonexistent/ckpt", "--prompt", "hi"], ["--ckpt:", "/nonexistent"]),
    "generate_corrupt_meta": (["generate", "--ckpt", "{corrupt}", "--prompt", "hi"], ["--ckpt:", "meta.pt"]),
    "eval_truncated_shard": (["eval", "--ckpt", "{truncated}"], ["--ckpt:", ".distcp is truncated"]),
    "convert_partial": (["convert", "dcp-to-hf", "--ckpt", "{partial}", "--output_dir", "{empty}/hf"], ["--ckpt:"]),
    "convert_dtype": (["convert", "dcp-to-hf", "--ckpt", "x", "--output_dir", "y", "--dtype", "float8"], ["--dtype:"]),
    "generate_top_p": (["generate", "--ckpt", "x", "--prompt", "hi", "--top_p", "2"], ["--top_p:", "top_p=2.0"]),
    "generate_abbreviation": (["generate", "--ck", "x", "--prompt", "hi"], ["--ckpt:", "are required: --ckpt"]),
    "check_env_option": (["check-env", "--bogus"], ["--bogus:", "unknown option"]),
}


@pytest.mark.parametrize("case", list(TOOL_CASES))
def test_tools_bad_input_is_one_line(case, bad_files, tmp_path):
    """generate / eval / convert / check-env: a missing, half-written or corrupt checkpoint (a truncated shard is
    named before DCP's read fails with a bare EOFError) and a bad option value are one line, exit 2, no usage block."""
    truncated = tmp_path / "t" / "step=000004.ckpt"
    DCPCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(64)}, "lr_schedulers": []}, truncated)
    shard = sorted(truncated.glob("*.distcp"))[0]  # a rank writes WRITER_THREADS shard files
    shard.write_bytes(shard.read_bytes()[:10])
    args, expected = TOOL_CASES[case]
    proc = kforge_in_process(*[a.format(truncated=truncated, **bad_files) for a in args])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("kforge: error: "), proc.stderr[-3000:]
    for text in expected:
        assert text in lines[0], (text, lines[0])


def test_a_checkpoint_folder_without_room_for_one_checkpoint_is_refused(tmp_path, started, monkeypatch):
    """The estimate (7.2M parameters x 4 bytes x (1 + 2 AdamW states) = 86 MB for debug.yaml) against free bytes."""
    import shutil

    import kempnerforge.checkpoint.disk as disk

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: usage._replace(free=50 * 2**20))
    proc = kforge_in_process(*_recipe("debug", tmp_path))
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and line.startswith("kforge: error: ModelCheckpoint.dirpath: "), line
    needed = ModelConfig(**_debug_model_config()).num_params() * 4 * 3
    assert f"{format_bytes(50 * 2**20)} free" in line and f"needs about {format_bytes(needed)}" in line, line
    assert started == []


def _debug_model_config() -> dict:
    import yaml

    return yaml.safe_load((REPO / "configs" / "debug.yaml").read_text())["model"]["config"]


@pytest.mark.slow
def test_a_real_kforge_process_prints_exactly_one_line(tmp_path):
    """The issue's case: the 7B VLM recipe on one machine (num_nodes: 2) used to wait at MEMBER: 1/2 forever and
    never report its missing encoder folder. Real process: whatever the interpreter or Lightning print counts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "kempnerforge.entry", *_recipe("vlm_7b_siglip2", tmp_path)]
    start = time.perf_counter()
    proc = run_group(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    print(f"real kforge process refused in {time.perf_counter() - start:.1f} s")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "kforge: error: model.encoder.pretrained_path: /n/models/google/siglip2-so400m-patch14-384 is not a "
        "transformers save_pretrained folder (no config.json there); nothing is downloaded"
    ]
    assert proc.stdout == ""


def test_rendezvous_short_of_ranks_fails_within_its_timeout(tmp_path, monkeypatch):
    """Check 3: num_nodes=2 on one machine; nobody else joins. Fails at the 20 s timeout with the counts and the
    settings that imply them (in-process: the wait is the same)."""
    # An earlier in-process Trainer.fit leaves MASTER_PORT behind (Lightning sets it), maybe with its store alive.
    monkeypatch.delenv("MASTER_PORT", raising=False)
    args = [
        *_recipe("debug", tmp_path),
        "--trainer.num_nodes=2",
        "--trainer.strategy.init_args.rendezvous_timeout_s=20",
    ]
    start = time.perf_counter()
    proc = kforge_in_process(*args)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kforge: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = lines
    assert line.startswith("kforge: error: trainer.num_nodes: 1 of 2 ranks joined the rendezvous"), line
    assert "within 20 s" in line and "trainer.num_nodes=2 x trainer.devices=1" in line, line
    assert 20 <= wall < 20 + 40, wall  # the timeout, plus set-up on a busy 2-core machine
    print(f"rendezvous refused after {wall:.1f} s (timeout 20 s)")


def test_kforge_help_lists_every_command_without_importing_torch():
    """Check 8 (the time is measured and printed, not asserted): one line per command."""
    code = (
        "import sys, time; t = time.perf_counter(); from kempnerforge.entry import main; main(['--help']); "
        "print('seconds', time.perf_counter() - t); print('torch imported', 'torch' in sys.modules)"
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in [*LIGHTNING_COMMANDS, *TOOLS]:
        assert any(line.strip().startswith(name + " ") for line in out.splitlines()), name
    for name in ("prepare-data", "generate", "convert", "eval", "validate", "estimate", "check-env"):
        assert name in TOOLS or name in LIGHTNING_COMMANDS
    assert "torch imported False" in out
    print(f"kforge --help: {wall:.2f} s for the whole interpreter ({out.splitlines()[-2]})")


@pytest.mark.parametrize(("command", "hint"), [("fitt", "did you mean fit? "), ("bogus", "")])
def test_an_unknown_command_is_one_line_naming_every_command_without_importing_lightning(command, hint):
    code = (
        "import sys; from kempnerforge.entry import main\n"
        f"try: main([{command!r}, '--config', 'configs/debug.yaml'])\n"
        "except SystemExit as e: print('exit', e.code, 'lightning imported', 'lightning' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "exit 2 lightning imported False", proc.stdout + proc.stderr
    names = ", ".join([*LIGHTNING_COMMANDS, *TOOLS])
    assert proc.stderr.splitlines() == [f"kforge: error: {command}: unknown command; {hint}choose one of {names}"]


def test_fit_help_names_real_fields():
    proc = kforge_in_process("fit", "--config", "configs/debug.yaml", "--help")
    assert proc.returncode == 0
    assert "scheduler.name" not in proc.stdout and "scheduler.decay" in proc.stdout


def test_bf16_on_cpu_warns_naming_the_setting():
    from unittest import mock

    from kempnerforge.preflight import warn_bf16_on_cpu
    from kempnerforge.strategies import KempnerStrategy

    trainer = Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", strategy=KempnerStrategy(), logger=False)
    with mock.patch("lightning.pytorch.utilities.rank_zero.rank_zero_warn") as warn:
        warn_bf16_on_cpu(trainer, "bf16-mixed")  # the configured value (the strategy may map it onto its policy)
    (message,) = warn.call_args.args
    assert message.startswith("trainer.precision=bf16-mixed on CPU") and "mixed_precision_param" in message
    trainer = Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), logger=False)
    with mock.patch("lightning.pytorch.utilities.rank_zero.rank_zero_warn") as warn:
        warn_bf16_on_cpu(trainer)
    warn.assert_not_called()
