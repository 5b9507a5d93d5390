"""Video on the model side (issue 6, check 2): clips of padded frames enter every arch like images, padded frames
never reach a real token, an image is a 1-frame clip, lengths are validated with max_frames, and the module sums
the data's skipped clips into ``data/skipped_clips`` at the log interval."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from kempnerforge.model.vlm import ARCHS
from kempnerforge.model.vlm.model import VisionLanguageModel
from kempnerforge.module import VisionLanguage, check_vlm_lengths
from tests.vlm_tiny import tiny_connector, tiny_encoder, tiny_text, tiny_vlm

ARCH_NAMES = sorted(ARCHS)


def _vlm(arch: str) -> VisionLanguageModel:
    torch.manual_seed(0)
    model = VisionLanguageModel(tiny_text(), tiny_vlm(arch), tiny_encoder(), tiny_connector())
    model.init_weights(0)
    if arch == "cross_attention":  # open the gates, or images could not influence anything
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_gate"):
                    p.fill_(0.7)
    return model.eval()


def _clip_batch(frames: int = 3):
    """Two clips: 3 real frames, and 1 real frame + 2 padded; text right-padded (12 and 7 tokens)."""
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(2, frames, 3, 32, 32, generator=g)
    frame_mask = torch.tensor([[True] * frames, [True] + [False] * (frames - 1)])
    ids = torch.randint(0, 128, (2, 12), generator=g)
    text_mask = torch.arange(12)[None] < torch.tensor([12, 7])[:, None]
    return pixels, frame_mask, ids, text_mask


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_padded_frame_pixels_never_reach_real_tokens(arch):
    model = _vlm(arch)
    pixels, frame_mask, ids, text_mask = _clip_batch()
    other = pixels.clone()
    other[~frame_mask] = 50 * torch.randn_like(other[~frame_mask])
    with torch.no_grad():
        out = model(ids, pixels, text_mask, frame_mask=frame_mask)
        out2 = model(ids, other, text_mask, frame_mask=frame_mask)
        # The collator's host count of real frames: fixed-size gathers (no read-back), the same values.
        out3 = model(ids, other, text_mask, frame_mask=frame_mask, real_frames=int(frame_mask.sum()))
        # Unmasked control: the same pixel change, no frame_mask -> the padded clip's real text changes.
        ctl = model(ids, pixels, text_mask)
        ctl2 = model(ids, other, text_mask)
    torch.testing.assert_close(out2[text_mask], out[text_mask], rtol=0, atol=0)
    torch.testing.assert_close(out3, out2, rtol=0, atol=0)
    assert (ctl2[1][text_mask[1]] - ctl[1][text_mask[1]]).abs().max() > 1e-3
    torch.testing.assert_close(ctl2[0], ctl[0], rtol=0, atol=0)  # the unpadded clip is untouched either way


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_frame_mask_masks_padded_frame_tokens_as_keys(arch):
    """Even when padded frames' tokens are not zeros (any encoder output), the per-frame mask hides them in the
    backbone's attention (and MoMa's routing): the mask, not the zeros, carries correctness."""
    model = _vlm(arch)
    pixels, frame_mask, ids, text_mask = _clip_batch()
    with torch.no_grad():
        tokens = model.visual_tokens(pixels)  # every frame encoded: padded ones hold real-looking tokens
        per_token = frame_mask.repeat_interleave(model.n_visual, dim=1)
        noisy = torch.where(per_token[..., None], tokens, 30 * torch.randn_like(tokens))
        a = model.backbone(ids, tokens, text_mask, per_token)
        b = model.backbone(ids, noisy, text_mask, per_token)
        zeros = model(ids, pixels, text_mask, frame_mask=frame_mask)  # padded frames skipped -> zero tokens
    torch.testing.assert_close(b[text_mask], a[text_mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(zeros[text_mask], a[text_mask], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_an_image_is_a_one_frame_clip(arch):
    model = _vlm(arch)
    pixels, _, ids, text_mask = _clip_batch()
    image = pixels[:, 0]
    with torch.no_grad():
        as_image = model(ids, image, text_mask)
        ones = torch.ones(2, 1, dtype=torch.bool)
        as_clip = model(ids, image[:, None], text_mask, frame_mask=ones, real_frames=2)  # all real, known on the host
        as_masked_clip = model(ids, image[:, None], text_mask, frame_mask=ones)  # the mask goes to attention
        as_unmasked_clip = model(ids, image[:, None], text_mask)
    torch.testing.assert_close(as_clip, as_image, rtol=0, atol=0)
    torch.testing.assert_close(as_unmasked_clip, as_image, rtol=0, atol=0)
    # The masked kernel differs only at padded text positions (whose labels are ignored).
    torch.testing.assert_close(as_masked_clip[text_mask], as_image[text_mask], rtol=1e-5, atol=1e-6)
    assert model.visual_tokens(pixels).shape == (2, 3 * model.n_visual, 32)  # F x tokens_per_frame, frame order
    torch.testing.assert_close(model.visual_tokens(pixels)[:, model.n_visual : 2 * model.n_visual],
                               model.visual_tokens(pixels[:, 1]))  # fmt: skip


def test_bad_video_inputs_are_refused():
    model = _vlm("joint_decoder")
    pixels, frame_mask, ids, _ = _clip_batch()
    with pytest.raises(ValueError, match=r"frame_mask must be \(batch, frames\) = \(2, 3\); got \(2, 2\)"):
        model(ids, pixels, frame_mask=frame_mask[:, :2])
    with pytest.raises(ValueError, match="frame_mask is for clips"):
        model(ids, pixels[:, 0], frame_mask=frame_mask)
    with pytest.raises(ValueError, match=r"pixel_values must be .*got \(3, 32, 32\)"):
        model(ids, pixels[0, 0])


@pytest.mark.parametrize(("arch", "frames", "ok"), [("joint_decoder", 3, True), ("joint_decoder", 4, False),
                                                    ("mot", 4, False), ("cross_attention", 8, True)])  # fmt: skip
def test_max_seq_len_covers_max_frames_times_tokens_plus_text(arch, frames, ok):
    # 16 tokens per frame, 16 text tokens, max_seq_len 64: 3 frames fit a joint sequence (64), 4 do not (80);
    # cross-attention's self-attention sees text only.
    if ok:
        check_vlm_lengths(tiny_text(max_seq_len=64), tiny_vlm(arch), 16, 16, frames)
        return
    with pytest.raises(ValueError, match=r"sees 80 positions \(data.max_frames=4 x 16 visual \+ 16 text.*max_frames"):
        check_vlm_lengths(tiny_text(max_seq_len=64), tiny_vlm(arch), 16, 16, frames)


class _ClipBatches(torch.utils.data.Dataset):
    """Fixed clip batches whose ``skipped_clips`` are 1, 0, 2, 0, 3, 0 (as a video collator reports them)."""

    skipped = [1, 0, 2, 0, 3, 0]

    def __len__(self) -> int:
        return len(self.skipped)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        pixels, frame_mask, ids, text_mask = _clip_batch()
        labels = torch.where(text_mask, ids.roll(-1, dims=1), -100)
        return {"input_ids": ids, "labels": labels, "text_mask": text_mask, "pixel_values": pixels,
                "frame_mask": frame_mask, "skipped_clips": torch.tensor(self.skipped[i])}  # fmt: skip


def test_skipped_clips_are_summed_and_logged_at_the_log_interval(tmp_path):
    module = VisionLanguage(config=tiny_text(), vlm=tiny_vlm("joint_decoder"), encoder=tiny_encoder())
    loader = torch.utils.data.DataLoader(_ClipBatches(), batch_size=None)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=6, log_every_n_steps=2, limit_val_batches=0,
                      logger=CSVLogger(tmp_path, name="m"), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)  # fmt: skip
    with pytest.warns(UserWarning, match=r"data: 6 unreadable clip\(s\) skipped so far"):  # on the console too
        trainer.fit(module, train_dataloaders=loader)
    import csv

    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = {int(r["step"]): float(r["data/skipped_clips"]) for r in rows if r.get("data/skipped_clips")}
    assert logged == {1: 1.0, 3: 3.0, 5: 6.0}  # cumulative, at steps 2, 4, 6
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize(("arch", "joint"), [("joint_decoder", True), ("mot", True), ("cross_attention", False)])
def test_flops_per_token_counts_the_visual_positions_a_joint_sequence_runs(arch, joint):
    """MFU's FLOP count: a joint sequence runs every frame's tokens through the blocks (not the head); a clip of
    3 frames costs more than an image; cross-attention's self-attention sees text only."""
    module = VisionLanguage(config=tiny_text(), vlm=tiny_vlm(arch), encoder=tiny_encoder())
    cfg, text = module.config, 12
    head = 6 * cfg.vocab_size * cfg.dim
    image = module.flops_per_token(text)  # before any batch: one image's tokens (16)
    module.configure_model()
    module._logits({"input_ids": torch.zeros(1, text, dtype=torch.long), "pixel_values": torch.zeros(1, 3, 3, 32, 32)})
    clip = module.flops_per_token(text)
    if not joint:
        assert image == clip == cfg.flops_per_token(text)
        return
    for n_visual, value in ((16, image), (48, clip)):
        s = n_visual + text
        assert value == (s * (cfg.flops_per_token(s) - head) + text * head) // text
    assert clip > image > cfg.flops_per_token(text)
