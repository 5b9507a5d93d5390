"""Issue 28, check 6 (the cases of item 5 owned here): each bad input is exactly one stderr line
``kforge: error: <field>: ...``, exit 2, no traceback, and nothing written (the output / checkpoint / log folder
unchanged). ``fit`` runs in-process (tests/e2e/inprocess.py) with whatever would start a process group, a launch or
a model replaced by recorders (the ``started`` fixture of test_user_errors.py); the tools are called as functions.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kempnerforge.data.prepare_cli import prepare_main
from kempnerforge.tools.convert import convert_main
from tests.e2e.inprocess import kforge_in_process
from tests.e2e.test_user_errors import started  # noqa: F401  (the fixture)
from tests.tmpfs import mounted_tmpfs


def _tree(folder):
    """Every path under ``folder`` with its bytes (None for a folder): what 'nothing written' compares."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def _one_line(code, err: str, field: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2, (code, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"kforge: error: {field}:"), lines[0]
    return lines[0]


FIT = {  # extra arguments, the field the line names, a substring of what it says
    "max_steps": (["--trainer.max_steps=-5"], "trainer.max_steps", "-1 (no limit)"),
    "devices": (["--trainer.devices=0"], "trainer.devices", ">= 1"),
    "accumulate": (["--trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches", ">= 1"),
    "ckpt_file": (["--ckpt_path", "README.md"], "ckpt_path", "is a file that is not a checkpoint"),
    "empty_config": (["--config", "{empty_yaml}"], "--config", "empty"),
    "dp_shards": (
        ["--trainer.strategy.init_args.dp_shards=2"],
        "trainer.strategy.init_args.dp_shards",
        "did you mean dp_shard?",
    ),  # fmt: skip
    "cp_seq_len": (
        ["--trainer.strategy.init_args.cp=3", "--trainer.devices=3"],
        "data.seq_len",
        "divisible by 2 x cp = 6",
    ),  # fmt: skip
    "cp_ring_cpu": (
        ["--trainer.strategy.init_args.cp=2", "--trainer.devices=2", "--trainer.strategy.init_args.cp_attention=ring"],
        "trainer.strategy.init_args.cp_attention",
        "no sharding rule for the CPU SDPA kernel",
    ),  # fmt: skip
    "cp_attention": (
        ["--trainer.strategy.init_args.cp_attention=zigzag"],
        "trainer.strategy.init_args.cp_attention",
        "use one of allgather, ring",
    ),  # fmt: skip
    "cp_ep": (
        ["--trainer.strategy.init_args.cp=2", "--trainer.strategy.init_args.ep=4", "--trainer.devices=2"],
        "trainer.strategy.init_args.ep",
        "ep=4 must divide dp_shard x cp = 1 x 2 = 2",
    ),  # fmt: skip
    "grad_clip": (["--model.grad_clip=-1"], "model.grad_clip", ">= 0"),
}


@pytest.mark.parametrize("name", list(FIT))
def test_fit_bad_input_is_one_line(name, tmp_path, started):  # noqa: F811
    extra, field, want = FIT[name]
    (tmp_path / "empty.yaml").write_text("")
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    args = ["fit", "--config", "configs/debug.yaml", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={root}", f"--trainer.callbacks.init_args.dirpath={ckpt}"]  # fmt: skip
    result = kforge_in_process(*args, *[a.format(empty_yaml=tmp_path / "empty.yaml") for a in extra])
    line = _one_line(result.returncode, result.stderr, field)
    assert want in line, line
    assert started == [] and not root.exists() and not ckpt.exists(), (started, line)


def test_fit_refuses_data_tokenized_beyond_the_models_vocabulary(tmp_path, started, shakespeare_tokens):  # noqa: F811
    """Found before any process starts (preflight reads metadata.json), not by the dataset after the rendezvous."""
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    result = kforge_in_process(
        "fit", "--config", "configs/debug.yaml", "--trainer.logger=false", f"--trainer.default_root_dir={root}",
        f"--trainer.callbacks.init_args.dirpath={ckpt}", "--data.source=null", "--data.tokenizer=null",
        f"--data.data_dir={shakespeare_tokens}", "--model.config.vocab_size=1000",
    )  # fmt: skip
    line = _one_line(result.returncode, result.stderr, "data.data_dir")
    assert "has vocab_size=50257" in line and "the model's vocab_size=1000" in line, line
    assert started == [] and not root.exists() and not ckpt.exists(), (started, line)


def _run(fn, argv, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        fn(argv)
    return exit_.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory):
    """A tiny weights checkpoint (hf-to-dcp of a random Llama with GPT-2's tokenizer), exported back once."""
    import transformers as tf

    from tests.hf_folders import save_random

    root = tmp_path_factory.mktemp("convert")
    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    hf = save_random(tf.LlamaForCausalLM, cfg, root / "hf")
    convert_main(["hf-to-dcp", "--hf_dir", str(hf), "--output_dir", str(root / "dcp")])
    return root


def test_dcp_to_hf_refuses_a_non_empty_folder_and_overwrite_replaces_it_whole(trained_ckpt, tmp_path, capsys,
                                                                              gpt2_tokenizer_dir):  # fmt: skip
    out = tmp_path / "hf_out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "chat_template.jinja").write_text("an old template")  # a file the new export does not write
    before = _tree(out)
    code, err = _run(convert_main, ["dcp-to-hf", "--ckpt", str(trained_ckpt / "dcp"), "--output_dir", str(out)], capsys)
    line = _one_line(code, err, "--output_dir")
    assert "--overwrite" in line and _tree(out) == before
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, err = _run(convert_main, ["dcp-to-hf", "--ckpt", str(trained_ckpt / "dcp"), "--output_dir", str(blocker)],
                     capsys)  # fmt: skip
    assert "is a file" in _one_line(code, err, "--output_dir") and blocker.read_text() == "x"
    code, err = _run(convert_main, ["dcp-to-hf", "--ckpt", str(trained_ckpt / "dcp"), "--output_dir",
                                    str(tmp_path / "new"), "--tokenizer", str(blocker)], capsys)  # fmt: skip
    _one_line(code, err, "--tokenizer")
    assert not (tmp_path / "new").exists()
    convert_main(["dcp-to-hf", "--ckpt", str(trained_ckpt / "dcp"), "--output_dir", str(out), "--overwrite"])
    names = sorted(p.name for p in out.iterdir())
    assert "chat_template.jinja" not in names and "model.safetensors" in names, names  # replaced whole, not mixed
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 96
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_hf_to_dcp_refuses_a_tokenizer_larger_than_the_vocabulary(trained_ckpt, tmp_path, capsys, gpt2_tokenizer_dir):
    hf = tmp_path / "hf"
    shutil.copytree(trained_ckpt / "hf", hf)
    for f in gpt2_tokenizer_dir.iterdir():
        shutil.copy(f, hf / f.name)
    code, err = _run(convert_main, ["hf-to-dcp", "--hf_dir", str(hf), "--output_dir", str(tmp_path / "out")], capsys)
    line = _one_line(code, err, "--hf_dir")
    assert "50257 tokens" in line and "vocab_size is 96" in line, line
    assert not (tmp_path / "out").exists()


PREPARE = {  # jsonl lines, the field, a substring of the line
    "no_record_has_it": (['{"body": "a"}', '{"text": null}'], "--text_field", "none of the 2 records"),
    "bad_line": (['{"text": "a"}', '{"text": "b"}', "{bad json"], "--source", "line 3 is not JSON"),
}


@pytest.mark.parametrize("name", list(PREPARE))
def test_prepare_data_bad_jsonl_is_one_line(name, tmp_path, capsys, gpt2_tokenizer_dir):
    lines, field, want = PREPARE[name]
    (tmp_path / "src.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    code, err = _run(prepare_main, ["--source", str(tmp_path / "src.jsonl"), "--tokenizer", str(gpt2_tokenizer_dir),
                                    "--output_dir", str(out), "--progress", "false"], capsys)  # fmt: skip
    assert want in _one_line(code, err, field)
    assert not out.exists()


def test_prepare_data_counts_records_without_the_field(tmp_path, capsys, gpt2_tokenizer_dir):
    (tmp_path / "src.jsonl").write_text('{"text": "hello world"}\n{"body": "x"}\n{"body": "y"}\n{"text": "more"}\n')
    prepare_main(["--source", str(tmp_path / "src.jsonl"), "--tokenizer", str(gpt2_tokenizer_dir),
                  "--output_dir", str(tmp_path / "out"), "--progress", "false"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kforge: warning: --text_field: 2 records have no 'text' and were skipped"], err
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["num_documents"] == 2 and meta["num_records_without_text_field"] == 2


GENERATE = {  # arguments after --ckpt, the field
    "empty_prompt": (["--prompt", "  "], "--prompt"),
    "tokenizer_missing": (["--prompt", "a", "--tokenizer", "/nonexistent/tok"], "--tokenizer"),
    "tokenizer_file": (["--prompt", "a", "--tokenizer", "README.md"], "--tokenizer"),
    "device_cuda": (["--prompt", "a", "--device", "cuda"], "--device"),
}


@pytest.mark.parametrize("name", list(GENERATE))
def test_generate_bad_arguments_are_one_line(name, tmp_path, capsys):
    import torch

    from kempnerforge.tools.generate import generate_main

    extra, field = GENERATE[name]
    if name == "device_cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA build: --device cuda is valid")
    code, err = _run(generate_main, ["--ckpt", str(tmp_path / "none"), *extra], capsys)
    line = _one_line(code, err, field)
    assert line.startswith(f"kforge: error: {field}: ") and len(line) > len(field) + 25, line  # says what is allowed
    assert list(tmp_path.iterdir()) == []  # refused before the checkpoint is read: nothing written


@pytest.fixture
def read_only(tmp_path):
    """A read-only tmpfs (read-only for root too); skipped where it cannot be mounted."""
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        yield mnt


def _inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "emptydir").mkdir(exist_ok=True)
    return tmp_path / "empty.txt", tmp_path / "emptydir"


EVAL = {  # arguments after --ckpt (never read: the data arguments are checked first), the field, what it says
    "missing_source": (["--source", "/nonexistent.txt"], "--source", "does not exist"),
    "empty_source": (["--source", "{empty}"], "--source", "is empty (1 file of 0 bytes)"),
    "missing_data_dir": (["--data_dir", "/nonexistent"], "--data_dir", "does not exist"),
    "empty_data_dir": (["--data_dir", "{emptydir}"], "--data_dir", "holds no prepared token shards"),
    "tokenizer_file": (["--source", "README.md", "--tokenizer", "README.md"], "--tokenizer", "is a file"),
}


@pytest.mark.parametrize("name", list(EVAL))
def test_eval_bad_data_arguments_are_one_line(name, tmp_path):
    empty, emptydir = _inputs(tmp_path)
    extra, field, want = EVAL[name]
    args = [a.format(empty=empty, emptydir=emptydir) for a in extra]
    proc = kforge_in_process("eval", "--ckpt", str(tmp_path / "no_ckpt"), *args)
    assert want in _one_line(proc.returncode, proc.stderr, field)


def test_prepare_data_refuses_a_tokenizer_file_an_empty_source_and_a_read_only_output(tmp_path, read_only,
                                                                                       gpt2_tokenizer_dir):  # fmt: skip
    empty, _ = _inputs(tmp_path)
    cases = [
        (["--source", "README.md", "--tokenizer", "README.md", "--output_dir", str(tmp_path / "o")], "--tokenizer"),
        (["--source", str(empty), "--tokenizer", str(gpt2_tokenizer_dir), "--output_dir", str(tmp_path / "o")],
         "--source"),
        (["--source", "README.md", "--tokenizer", str(gpt2_tokenizer_dir), "--output_dir", str(read_only / "o")],
         "--output_dir"),
    ]  # fmt: skip
    for args, field in cases:
        proc = kforge_in_process("prepare-data", *args, "--progress", "false")
        line = _one_line(proc.returncode, proc.stderr, field)
        assert not (tmp_path / "o").exists(), line
    assert "read-only filesystem" in line


FIT_PATHS = {  # extra fit arguments, the field, what it says
    "empty_source": (["--data.source={empty}", "--data.data_dir={tmp}/tok"], "data.source", "is empty"),
    "tokenizer_file": (
        ["--data.source=README.md", "--data.tokenizer=README.md", "--data.data_dir={tmp}/tok"],
        "data.tokenizer",
        "is a file",
    ),  # fmt: skip
    "log_under_a_file": (
        ["--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.save_dir=README.md/runs"],
        "trainer.logger.init_args.save_dir",
        "README.md is a file",
    ),  # fmt: skip
    "read_only_log": (
        ["--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.save_dir={ro}/runs"],
        "trainer.logger.init_args.save_dir",
        "read-only filesystem",
    ),  # fmt: skip
    "read_only_data_dir": (
        ["--data.source=README.md", "--data.data_dir={ro}/tok"],
        "data.data_dir",
        "read-only filesystem",
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(FIT_PATHS))
def test_fit_bad_paths_are_one_line_before_anything_starts(name, tmp_path, read_only, started):  # noqa: F811
    empty, _ = _inputs(tmp_path)
    extra, field, want = FIT_PATHS[name]
    ckpt = tmp_path / "ckpt"
    args = [a.format(empty=empty, tmp=tmp_path, ro=read_only) for a in extra]
    proc = kforge_in_process("fit", "--config", "configs/debug.yaml", "--trainer.enable_progress_bar=false",
                             f"--trainer.callbacks.init_args.dirpath={ckpt}", *args)  # fmt: skip
    assert want in _one_line(proc.returncode, proc.stderr, field)
    assert started == [] and not ckpt.exists() and not (tmp_path / "tok").exists()


def test_generate_refuses_too_long_prompts_too_many_tokens_and_ids_beyond_the_vocabulary(trained_ckpt,
                                                                                          gpt2_tokenizer_dir):  # fmt: skip
    ckpt = str(trained_ckpt / "dcp")
    tok = trained_ckpt / "tok96"  # a 96-token model needs a tokenizer whose ids fit: the first ids of GPT-2's
    cases = {
        "--prompt": ["--prompt", "a " * 40, "--max_new_tokens", "1"],  # 40 tokens > max_seq_len 32
        "--max_new_tokens": ["--prompt", "a", "--max_new_tokens", "1000"],
        "--tokenizer": [
            "--prompt",
            "To be",
            "--max_new_tokens",
            "2",
            "--tokenizer",
            str(gpt2_tokenizer_dir),
        ],  # ids > 95
    }
    for field, args in cases.items():
        if field != "--tokenizer" and not tok.exists():
            _ascii_tokenizer(tok)
        extra = [] if field == "--tokenizer" else ["--tokenizer", str(tok)]
        proc = kforge_in_process("generate", "--ckpt", ckpt, *extra, *args)
        line = _one_line(proc.returncode, proc.stderr, field)
        assert "max_seq_len=32" in line if field != "--tokenizer" else "vocab_size is 96" in line, line


def _ascii_tokenizer(folder):
    """A character-level tokenizer of 96 ids (printable ASCII; EOS is id 95) for the 96-token test model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True)
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab["<|endoftext|>"] = 95
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(folder / "tokenizer.json"))


def test_init_from_seq_len_beyond_the_folder_says_what_fits(trained_ckpt, tmp_path, shakespeare_tokens, started,  # noqa: F811
                                                            gpt2_tokenizer_dir):  # fmt: skip
    """The seq_len advice under init_from names the folder's ceiling (raising max_seq_len is refused there)."""
    proc = kforge_in_process("fit", "--config", "configs/finetune_debug.yaml",
                             f"--model.init_from={trained_ckpt / 'hf'}", f"--data.data_dir={shakespeare_tokens}",
                             f"--data.tokenizer={gpt2_tokenizer_dir}", "--data.seq_len=64", f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}")  # fmt: skip
    line = _one_line(proc.returncode, proc.stderr, "data.seq_len")
    assert "use data.seq_len <= 32" in line and "raise max_seq_len" not in line, line
    assert started == []
