"""Issue 32, check 4 (export half): ``kforge convert dcp-to-hf`` of a joint_decoder VLM writes a Hugging Face
``LlavaForConditionalGeneration`` folder, against ``transformers`` itself.

A tiny VLM (SigLIP or CLIP random tower, ``mlp2`` connector, tied 2-layer decoder on GPT-2's vocabulary) trains one
step through KempnerStrategy and is exported. transformers loads the folder with no missing or unexpected keys; its
``AutoProcessor`` expands ``<image>`` (added to the tokenizer: GPT-2 has none, so the vocabulary grows by one zero
row) into the image's 16 positions; on 3 image + text prompts its logits at the text positions equal ours (1e-5), and
its greedy ``generate`` equals ``kforge generate``'s library call for 20 tokens. What LLaVA cannot express is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image

from kempnerforge.checkpoint.hf_llava import check_llava_exportable
from kempnerforge.config.vision import ConnectorConfig, VisionEncoderConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.generate import SamplingConfig
from kempnerforge.model.vlm_generate import generate_with_image
from tests.vlm_tiny import GPT2, IMAGES, tiny_encoder, tiny_text, tiny_vlm

PROMPTS = ["A photo of", "The picture shows a large", "In this image"]
PHOTOS = ["astronaut.png", "coffee.png", "chelsea.png"]


def _encoder(family: str) -> VisionEncoderConfig:
    cfg = tiny_encoder(family)
    cfg.feature_layer = -1 if family == "siglip" else None  # CLIP's default (last hidden state) is LLaVA's -1
    return cfg


@pytest.fixture(scope="module", params=["siglip", "clip"])
def exported(request, tmp_path_factory):
    """``(loaded kforge VLM, exported folder, encoder config)`` after one training step."""
    from kempnerforge.checkpoint.convert import dcp_to_hf
    from kempnerforge.checkpoint.load import load_vlm_checkpoint
    from kempnerforge.data.vlm_datamodule import ImageTextDataModule
    from kempnerforge.module import VisionLanguage
    from kempnerforge.strategies import KempnerStrategy

    root = tmp_path_factory.mktemp(f"llava_{request.param}")
    encoder = _encoder(request.param)
    text = tiny_text(vocab_size=50257, max_seq_len=64, tie=True)
    module = VisionLanguage(text, tiny_vlm("joint_decoder"), encoder, ConnectorConfig(type="mlp2"))
    data = ImageTextDataModule(source=str(IMAGES / "captions.jsonl"), tokenizer=str(GPT2), max_text_len=16)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", filename="s{step}", every_n_train_steps=1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), max_steps=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt])  # fmt: skip
    trainer.fit(module, datamodule=data)
    if dist.is_initialized():  # set up before the per-test clean-up fixture (tests/unit/conftest.py) can see it
        dist.destroy_process_group()
    out = dcp_to_hf(root / "ckpt", root / "hf")
    return load_vlm_checkpoint(root / "ckpt"), out


def _hf(folder):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model, info = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    return model.eval(), AutoProcessor.from_pretrained(folder), info


def test_transformers_loads_the_folder_with_no_missing_or_unexpected_keys(exported):
    _, folder = exported
    model, processor, info = _hf(folder)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.image_token_id == 50257 and model.config.text_config.vocab_size == 50258
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == 50257


def test_logits_on_three_image_prompts_equal_ours(exported):
    loaded, folder = exported
    model, processor, _ = _hf(folder)
    n = loaded.model.n_visual
    for photo, prompt in zip(PHOTOS, PROMPTS, strict=True):  # one row each: no padding to line up
        inputs = processor(images=[Image.open(IMAGES / photo).convert("RGB")], text=[f"<image>{prompt}"],
                           return_tensors="pt")  # fmt: skip
        ids = inputs["input_ids"]
        assert (ids[:, :n] == model.config.image_token_id).all() and ids.shape[1] > n
        with torch.no_grad():
            theirs = model(**inputs).logits[:, n:, : loaded.config.vocab_size]
            ours = loaded.model(ids[:, n:], inputs["pixel_values"])
        assert (ours - theirs).abs().max().item() <= 1e-5, photo


def test_greedy_generate_equals_transformers_for_20_tokens(exported):
    loaded, folder = exported
    model, processor, _ = _hf(folder)
    n = loaded.model.n_visual
    for photo, prompt in zip(PHOTOS, PROMPTS, strict=True):
        inputs = processor(images=[Image.open(IMAGES / photo).convert("RGB")], text=[f"<image>{prompt}"],
                           return_tensors="pt")  # fmt: skip
        with torch.no_grad():
            theirs = model.generate(**inputs, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        ours = generate_with_image(loaded.model, [inputs["input_ids"][0, n:].tolist()], inputs["pixel_values"],
                                   SamplingConfig(max_new_tokens=20))  # fmt: skip
        assert ours.row(0) == theirs[0, inputs["input_ids"].shape[1] :].tolist(), photo


@pytest.mark.parametrize(
    ("vlm", "connector", "feature_layer", "field"),
    [
        ("moma", "mlp2", -1, "vlm.arch='moma'"),
        ("joint_decoder", "avg_pool", -1, "connector.type='avg_pool'"),
        ("joint_decoder", "mlp2", None, "encoder.feature_layer=null"),
    ],
)
def test_what_llava_cannot_express_is_refused_in_one_line(vlm, connector, feature_layer, field):
    encoder = tiny_encoder()
    encoder.feature_layer = feature_layer
    with pytest.raises(ValueError, match=field.replace("(", r"\(")) as err:
        check_llava_exportable(VLMConfig(arch=vlm), encoder, ConnectorConfig(type=connector))
    assert "\n" not in str(err.value)


def test_hf_to_kforge_to_hf_rewrites_every_tensor_bit_exactly(exported, tmp_path):
    """The exported LLaVA folder imported (``hf-to-dcp``: a joint_decoder VLM checkpoint, the tower saved beside it)
    and exported again: every tensor of the second folder equals the first's, bit for bit."""
    from safetensors.torch import load_file

    from kempnerforge.checkpoint.convert import dcp_to_hf, hf_to_dcp
    from kempnerforge.checkpoint.load import load_vlm_checkpoint

    loaded, folder = exported
    hf_to_dcp(folder, tmp_path / "imported")
    again = dcp_to_hf(tmp_path / "imported", tmp_path / "again")
    first, second = load_file(folder / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and len(first) > 30
    assert all(torch.equal(first[k], second[k]) for k in first), [
        k for k in first if not torch.equal(first[k], second[k])
    ]
    imported = load_vlm_checkpoint(tmp_path / "imported")
    assert imported.model.n_visual == loaded.model.n_visual
    assert imported.config.vocab_size == 50258  # the image token's row comes along


def test_a_llava_folder_as_init_from_is_refused_naming_the_import(exported):
    from kempnerforge.errors import UserError
    from kempnerforge.module import VisionLanguage

    _, folder = exported
    with pytest.raises(UserError, match="is a LLaVA folder .* kforge convert hf-to-dcp") as err:
        VisionLanguage(init_from=str(folder))
    assert err.value.field == "model.init_from"
