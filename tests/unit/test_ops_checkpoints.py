"""Issue 9 checks 1, 2 and 4 on checkpoints trained in-process (dense, tied, Mixtral-style MoE):

1. dcp-to-hf -> ``AutoModelForCausalLM.from_pretrained`` logits == ours (fp32, 1e-5); hf-to-dcp ->
   bit-identical weights; an imported checkpoint starts ``fit`` with its weights and a fresh optimizer.
2. ``kforge generate`` greedy == ``transformers`` greedy ``generate`` (batch, left padding, EOS).
4. ``kforge eval`` perplexity == exp(validation loss) of the training run on the same data.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict

import pytest
import torch

from kempnerforge.checkpoint.convert import dcp_to_hf, hf_to_dcp
from kempnerforge.checkpoint.load import load_checkpoint_model
from kempnerforge.cli import main
from kempnerforge.model.generate import SamplingConfig, generate, left_pad
from tests.ops_helpers import train_checkpoint

transformers = pytest.importorskip("transformers")
KINDS = ("dense", "tied", "moe")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shakespeare_tokens):
    """kind -> (checkpoint folder, final val loss); three tiny 6-step runs."""
    root = tmp_path_factory.mktemp("ops")
    return {kind: train_checkpoint(root, shakespeare_tokens, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory, gpt2_tokenizer_dir):
    """kind -> transformers directory written by ``kforge convert dcp-to-hf`` (the CLI)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind, (ckpt, _) in trained.items():
        out[kind] = root / kind
        main(["convert", "dcp-to-hf", "--ckpt", str(ckpt), "--output_dir", str(out[kind]),
              "--tokenizer", str(gpt2_tokenizer_dir)])  # fmt: skip
    return out


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_to_hf_logits_match(kind, trained, exported):
    ours = load_checkpoint_model(trained[kind][0]).model
    hf = _hf(exported[kind])
    expected_class = {"dense": "LlamaForCausalLM", "tied": "LlamaForCausalLM", "moe": "MixtralForCausalLM"}[kind]
    assert type(hf).__name__ == expected_class
    tokens = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens), hf(input_ids=tokens).logits
    assert a.abs().max() > 1.0  # trained, not trivially small
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    files = {p.name for p in exported[kind].iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt"} <= files
    if kind == "tied":
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_export_carries_the_tokenizers_ids_is_readable_by_the_group_and_has_no_foreign_card(
    exported, gpt2_tokenizer_dir
):
    """A model trained on GPT-2's tokenizer ends text at its ``<|endoftext|>`` (50256), not at Llama's defaults 1 / 2
    (``"`` and ``#`` there); the folder gets the umask's permissions (safetensors writes 0600); the tokenizer's README
    is not copied as the model card."""
    import os
    import stat

    tok = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir, local_files_only=True)
    folder = exported["dense"]
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    generation = transformers.GenerationConfig.from_pretrained(folder, local_files_only=True)
    assert tok.eos_token_id == 50256 and tok.bos_token_id == 50256
    assert (config.bos_token_id, config.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert (generation.bos_token_id, generation.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask
    for f in folder.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, f.name
    assert (gpt2_tokenizer_dir / "README.md").is_file() and not (folder / "README.md").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_dcp_weights_bit_identical(kind, trained, exported, tmp_path):
    original = load_checkpoint_model(trained[kind][0])
    main(["convert", "hf-to-dcp", "--hf_dir", str(exported[kind]), "--output_dir", str(tmp_path)])
    back = load_checkpoint_model(tmp_path)
    # HF keeps the FFN width, not the rule that produced it (multiple_of / ffn_dim_multiplier).
    assert back.config.ffn_hidden == original.config.ffn_hidden
    differ = {k for k, v in asdict(back.config).items() if asdict(original.config)[k] != v}
    assert differ <= {"ffn_hidden_dim", "multiple_of", "ffn_dim_multiplier"}
    a, b = original.model.state_dict(), back.model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert (tmp_path / "model.yaml").is_file() and (tmp_path / "latest").read_text().strip() == "step=0.ckpt"


def test_bf16_export_and_sharding(trained, tmp_path):
    out = dcp_to_hf(trained["dense"][0], tmp_path / "bf16", dtype="bfloat16", max_shard_size="1MB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    ours = load_checkpoint_model(trained["dense"][0]).model
    assert torch.equal(hf.model.embed_tokens.weight, ours.tok_embeddings.weight.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_generate_greedy_equals_transformers(kind, trained, exported, gpt2_tokenizer_dir):
    tok = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir, local_files_only=True)
    prompts = ["ROMEO:\nWhat light", "First Citizen:", "O"]
    ids, mask = left_pad([tok.encode(p) for p in prompts], pad_token_id=tok.eos_token_id)
    model = load_checkpoint_model(trained[kind][0]).model
    ours = generate(model, ids, mask, SamplingConfig(max_new_tokens=12))
    hf = _hf(exported[kind])
    theirs = hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=tok.eos_token_id)  # fmt: skip
    assert torch.equal(ours.tokens, theirs[:, ids.shape[1] :])
    # EOS per row: stop row 0 at its 3rd token; transformers agrees on every row.
    eos = int(ours.tokens[0, 2])
    stopped = generate(model, ids, mask, SamplingConfig(max_new_tokens=12), eos_token_id=eos, pad_token_id=0)
    theirs = hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=12, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)  # fmt: skip
    assert stopped.lengths[0] <= 3
    assert torch.equal(stopped.tokens, theirs[:, ids.shape[1] :])


def test_generate_cli_prints_completion_and_throughput(trained, gpt2_tokenizer_dir, capsys, monkeypatch):
    main(["generate", "--ckpt", str(trained["tied"][0]), "--prompt", "ROMEO:", "--prompt", "JULIET: O",
          "--max_new_tokens", "5", "--tokenizer", str(gpt2_tokenizer_dir)])  # fmt: skip
    out = capsys.readouterr().out
    assert "--- [0] ROMEO:" in out and "--- [1] JULIET: O" in out
    assert "tokens/s" in out
    # The batch's row 0 is what the library's greedy generate gives for that prompt alone.
    tok = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir, local_files_only=True)
    model = load_checkpoint_model(trained["tied"][0]).model
    alone = generate(model, torch.tensor([tok.encode("ROMEO:")]), None, SamplingConfig(max_new_tokens=5),
                     eos_token_id=tok.eos_token_id)  # fmt: skip
    assert f"--- [0] ROMEO:{tok.decode(alone.row(0))}\n" in out
    monkeypatch.setattr("sys.stdin", io.StringIO("ROMEO:\n\nJULIET: O\n"))
    main(["generate", "--ckpt", str(trained["tied"][0]), "--interactive", "--max_new_tokens", "5",
          "--temperature", "0.8", "--top_k", "20", "--tokenizer", str(gpt2_tokenizer_dir)])  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("--- [0] ") == 2 and out.count("tokens/s") == 2  # one per non-empty line


@pytest.mark.parametrize("kind", ["tied", "moe"])
def test_eval_perplexity_equals_exp_val_loss(kind, trained):
    ckpt, val_loss = trained[kind]
    from kempnerforge.tools.evaluate import eval_main

    result = eval_main(["--ckpt", str(ckpt)])  # defaults: the run's data_dir, seq_len, val split
    assert result.loss == pytest.approx(val_loss, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(val_loss), rel=1e-5)
    chunked = eval_main(["--ckpt", str(ckpt), "--loss_chunk_size", "16"])  # the fused head: no full logits
    assert (chunked.loss, chunked.tokens) == (pytest.approx(result.loss, rel=1e-6), result.tokens)


def test_eval_hf_text_source(trained, tmp_path, shakespeare_text, gpt2_tokenizer_dir):
    """HF-datasets path (a jsonl file): equals the cross-entropy of the model on the tokenized text + EOS,
    cut into windows of seq_len + 1 tokens, computed here directly."""
    from kempnerforge.tools.evaluate import eval_main

    text = shakespeare_text.read_text()[200_000:202_000]
    src = tmp_path / "held_out.jsonl"
    src.write_text(json.dumps({"text": text}) + "\n")
    ckpt = trained["tied"][0]
    result = eval_main(["--ckpt", str(ckpt), "--source", str(src), "--tokenizer", str(gpt2_tokenizer_dir)])
    tok = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir, local_files_only=True)
    ids = torch.tensor(tok.encode(text) + [tok.eos_token_id])
    n = (len(ids) - 1) // 32  # windows of 33 tokens overlapping by one (next-token targets)
    windows = torch.stack([ids[i * 32 : i * 32 + 33] for i in range(n)])
    model = load_checkpoint_model(ckpt).model
    with torch.no_grad():
        logits = model(windows[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert result.tokens == n * 32 > 300
    assert result.loss == pytest.approx(float(expected), rel=1e-5)


def test_imported_checkpoint_starts_fit_with_its_weights_and_fresh_optimizer(trained, exported, tmp_path,
                                                                            shakespeare_tokens):  # fmt: skip
    from lightning.pytorch import Callback, Trainer

    from kempnerforge.data.datamodule import TokenDataModule
    from kempnerforge.module import CausalLM
    from kempnerforge.parallel.dtensor import to_full
    from kempnerforge.strategies import KempnerStrategy

    imported = hf_to_dcp(exported["tied"], tmp_path / "imported")
    expected = load_checkpoint_model(imported).model.state_dict()
    seen = {}

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            seen["weights"] = {k: to_full(v).detach().clone() for k, v in pl_module.model.state_dict().items()}
            seen["opt_state"] = len(trainer.optimizers[0].state)
            seen["step"] = trainer.global_step

    cfg = load_checkpoint_model(imported).config
    trainer = Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), max_steps=1, limit_val_batches=0,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[Probe()])  # fmt: skip
    data = TokenDataModule(str(shakespeare_tokens), seq_len=32, micro_batch_size=4, val_fraction=0.05)
    trainer.fit(CausalLM(cfg), datamodule=data, ckpt_path=str(tmp_path / "imported"))
    assert seen["step"] == 0 and seen["opt_state"] == 0
    for key, value in expected.items():
        assert torch.equal(seen["weights"][key], value), key
    assert trainer.global_step == 1


def test_refuses_what_hf_cannot_represent(tmp_path, shakespeare_tokens):
    from kempnerforge.checkpoint.convert import hf_family
    from kempnerforge.config import ModelConfig

    base = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32, multiple_of=16)
    for fields, name in [({"qk_norm": True, "attention_bias": True}, "attention_bias"), ({"num_experts": 4, "router": "sigmoid"}, "router"),
                         ({"num_experts": 4, "n_shared_experts": 1}, "shared_expert_gate"),
                         ({"num_experts": 4, "route_scale": 2.0}, "route_scale"),
                         ({"num_experts": 4, "moe_frequency": 2}, "moe_frequency"),
                         ({"num_experts": 4, "capacity_factor": 1.5}, "capacity_factor")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            hf_family(ModelConfig(**base, **fields))


def test_qwen2_moe_export_with_gated_shared_experts(tmp_path):
    """Qwen-MoE: 2 shared experts (fused into HF's one shared expert), sigmoid shared gate, MoE on every 2nd
    layer, no top-k renormalization: logits within 1e-5 and a bit-identical round trip."""
    from kempnerforge.checkpoint.convert import write_weights_checkpoint
    from kempnerforge.checkpoint.load import build_model
    from kempnerforge.config import ModelConfig

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32, multiple_of=16,
                      num_experts=4, top_k=2, moe_frequency=2, n_shared_experts=2, shared_expert_gate=True,
                      router_renormalize=False, expert_width_multiplier=0.5, init_std=0.1)  # fmt: skip
    model = build_model(cfg)
    model.init_weights(seed=5)
    write_weights_checkpoint(model, cfg, tmp_path / "ours", "step=0.ckpt", source="test")
    out = dcp_to_hf(tmp_path / "ours", tmp_path / "hf")
    hf = _hf(out)
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, model.eval()(tokens), rtol=0, atol=1e-5)
    back = load_checkpoint_model(hf_to_dcp(out, tmp_path / "back"))
    assert back.config.expert_hidden == cfg.expert_hidden and back.config.n_shared_experts == 2
    for key, value in model.state_dict().items():
        assert torch.equal(back.model.state_dict()[key], value), key
