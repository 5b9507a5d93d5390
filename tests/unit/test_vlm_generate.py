"""`kforge generate --image`: image-conditioned decoding equals a token-by-token argmax of the training forward."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from kempnerforge.model.generate import SamplingConfig
from kempnerforge.model.vlm.model import VisionLanguageModel
from kempnerforge.model.vlm_generate import generate_with_image
from tests.vlm_tiny import GPT2, IMAGES, tiny_connector, tiny_encoder, tiny_mla_moe_text, tiny_text, tiny_vlm

PROMPTS = [[5, 17, 3, 99], [42, 7]]


def _model(arch: str, mla_moe: bool = False) -> VisionLanguageModel:
    text = tiny_mla_moe_text() if mla_moe else tiny_text()
    model = VisionLanguageModel(text, tiny_vlm(arch), tiny_encoder(), tiny_connector())
    model.init_weights(seed=0)
    with torch.no_grad():  # open cross-attention gates so the image matters
        for name, p in model.named_parameters():
            if name.endswith("_gate"):
                p.fill_(0.7)
    return model.eval()


def _oracle(model: VisionLanguageModel, prompt: list[int], pixels: torch.Tensor, n: int) -> list[int]:
    """Greedy decoding through the training forward on one unpadded row."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), pixels[None])[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    ("arch", "mla_moe"),
    [("joint_decoder", False), ("cross_attention", False), ("mot", False), ("joint_decoder", True),
     ("cross_attention", True)],
)  # fmt: skip
def test_greedy_batch_with_images_equals_per_row_training_forward(arch, mla_moe):
    """``mla_moe``: MLA + MoE text blocks (issue 32 item 2): the joint_decoder's cache holds MLA's latent."""
    model = _model(arch, mla_moe)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(max_new_tokens=6)
    out = generate_with_image(model, PROMPTS, pixels, sampling)
    for i, prompt in enumerate(PROMPTS):
        assert out.row(i) == _oracle(model, prompt, pixels[i], 6), (arch, i)
    if arch == "joint_decoder":  # KV cache with the visual prefix == recomputing everything
        assert torch.equal(generate_with_image(model, PROMPTS, pixels, sampling, use_cache=False).tokens, out.tokens)
    with torch.no_grad():  # the image conditions the output
        a = model(torch.tensor([PROMPTS[0]]), pixels[:1])[0, -1]
        b = model(torch.tensor([PROMPTS[0]]), pixels[1:])[0, -1]
    assert not torch.allclose(a, b)


def test_moma_and_mismatched_batches_are_refused():
    with pytest.raises(ValueError, match="vlm.arch='moma' is training-only"):
        generate_with_image(_model("moma"), PROMPTS, torch.zeros(2, 3, 32, 32))
    with pytest.raises(ValueError, match="1 images for 2 prompts"):
        generate_with_image(_model("mot"), PROMPTS, torch.zeros(1, 3, 32, 32))


def test_kforge_generate_image_on_a_trained_checkpoint(tmp_path):
    """One training step through KempnerStrategy writes a DCP checkpoint; `kforge generate --image` loads it in
    this process (no process group) and prints what the library decodes on the same weights."""
    from kempnerforge.checkpoint.load import load_vlm_checkpoint
    from kempnerforge.cli import main
    from kempnerforge.config.vision import ConnectorConfig
    from kempnerforge.data.vlm_datamodule import ImageTextDataModule
    from kempnerforge.model.vision import build_image_processor
    from kempnerforge.module import VisionLanguage
    from kempnerforge.strategies import KempnerStrategy

    text = tiny_text(vocab_size=50257, max_seq_len=64, tie=True)
    module = VisionLanguage(text, tiny_vlm("joint_decoder"), tiny_encoder(), ConnectorConfig(type="mlp2"))
    data = ImageTextDataModule(source=str(IMAGES / "captions.jsonl"), tokenizer=str(GPT2), max_text_len=16)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="s{step}", auto_insert_metric_name=False, every_n_train_steps=1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), max_steps=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt])  # fmt: skip
    trainer.fit(module, datamodule=data)
    image = IMAGES / "astronaut.png"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["generate", "--ckpt", str(tmp_path), "--image", str(image), "--prompt", "A photo of",
              "--max_new_tokens", "5", "--ignore_eos"])  # fmt: skip
    printed = buf.getvalue()
    assert "tokens/s" in printed
    loaded = load_vlm_checkpoint(tmp_path)
    for (name, p), q in zip(loaded.model.named_parameters(), module.model.parameters(), strict=True):
        assert torch.equal(p, q.detach()), name  # the checkpoint restored every weight, frozen encoder included
    from PIL import Image
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(GPT2))
    pixels = build_image_processor(tiny_encoder())(images=[Image.open(image).convert("RGB")], return_tensors="pt")
    out = generate_with_image(loaded.model, [tok.encode("A photo of")], pixels["pixel_values"].float(),
                              SamplingConfig(max_new_tokens=5))  # fmt: skip
    assert f"--- [0] A photo of{tok.decode(out.row(0))}" in printed
    with pytest.raises(SystemExit):  # a VLM checkpoint needs an image
        main(["generate", "--ckpt", str(tmp_path), "--prompt", "x"])


def test_kforge_generate_video_samples_frames_as_training_did(tmp_path):
    """One step on the bundled clips writes a checkpoint; `kforge generate --video` decodes the clip with the
    checkpoint's frame sampling and prints what the library generates from those frames."""
    from kempnerforge.checkpoint.load import load_vlm_checkpoint
    from kempnerforge.cli import main
    from kempnerforge.data.video_datamodule import VideoTextDataModule
    from kempnerforge.data.video_decode import read_frames
    from kempnerforge.data.video_sampling import FrameSampling, sample_frames
    from kempnerforge.model.vision import build_image_processor
    from kempnerforge.module import VisionLanguage
    from kempnerforge.strategies import KempnerStrategy

    videos = GPT2.parents[2] / "data" / "videos"
    text = tiny_text(vocab_size=50257, max_seq_len=96, tie=True)
    module = VisionLanguage(text, tiny_vlm("joint_decoder"), tiny_encoder(), tiny_connector())
    data = VideoTextDataModule(source=str(videos / "results.csv"), tokenizer=str(GPT2), max_text_len=16,
                               micro_batch_size=1, sampling="fixed_count", max_frames=3)  # fmt: skip
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="s{step}", auto_insert_metric_name=False, every_n_train_steps=1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), max_steps=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt])  # fmt: skip
    trainer.fit(module, datamodule=data)
    clip = videos / "clips" / "1000002.mp4"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["generate", "--ckpt", str(tmp_path), "--video", str(clip), "--prompt", "A", "--prompt", "In a",
              "--max_new_tokens", "4", "--ignore_eos"])  # fmt: skip
    printed = buf.getvalue()
    frames, times = read_frames(clip, lambda ts: sample_frames(ts, FrameSampling("fixed_count", max_frames=3)))
    assert len(frames) == 3 and times[0] == 0.0  # fixed_count keeps both endpoints
    assert f"--video {clip}: 3 frames at {', '.join(f'{t:.2f}' for t in times)} s (fixed_count)" in printed
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(GPT2))
    pixels = build_image_processor(tiny_encoder())(images=frames, return_tensors="pt")["pixel_values"].float()
    pixels = pixels[None].expand(2, *pixels.shape)
    out = generate_with_image(load_vlm_checkpoint(tmp_path).model, [tok.encode("A"), tok.encode("In a")], pixels,
                              SamplingConfig(max_new_tokens=4))  # fmt: skip
    assert f"--- [0] A{tok.decode(out.row(0))}" in printed and f"--- [1] In a{tok.decode(out.row(1))}" in printed
    with pytest.raises(SystemExit):
        main(["generate", "--ckpt", str(tmp_path), "--video", str(videos / "README.md"), "--prompt", "x"])
    with pytest.raises(SystemExit):
        main(["generate", "--ckpt", str(tmp_path), "--video", str(clip), "--image", str(clip), "--prompt", "x"])
