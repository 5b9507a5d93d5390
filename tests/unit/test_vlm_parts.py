"""VLM parts: connector token counts (check 3), the encoder from a save_pretrained folder (check 5),
image-caption data and labels, freeze specs and the freeze schedule's optimizer contract."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from kempnerforge.callbacks import FreezeSchedule
from kempnerforge.config.vision import CONNECTOR_TYPES, ConnectorConfig, VisionEncoderConfig
from kempnerforge.data.image_text import ImageDataError, ImageTextCollator, ImageTextDataset
from kempnerforge.model.connectors import Connector, connector_tokens
from kempnerforge.model.vision import VisionEncoder, build_image_processor
from kempnerforge.model.vlm.model import VisionLanguageModel
from kempnerforge.training.freeze import FreezeSpec, apply_freeze, init_adamw_state, trainable_names
from tests.vlm_tiny import GPT2, IMAGE_PARQUET, IMAGES, tiny_connector, tiny_encoder, tiny_text, tiny_vlm


@pytest.mark.parametrize("grid", [(4, 4), (4, 6), (6, 2), (8, 8)], ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("kind", CONNECTOR_TYPES)
def test_connector_counts_equal_forward_lengths(kind, grid):
    """Check 3: the up-front count equals the forward length, square and non-square grids."""
    cfg = tiny_connector(kind)
    n = connector_tokens(cfg, grid, 32)
    connector = Connector(cfg, 32, 48, grid)
    connector.init_weights(0)
    out = connector(torch.randn(3, grid[0] * grid[1], 32))
    assert out.shape == (3, n, 48)
    expected = {"mlp2": grid[0] * grid[1], "linear": grid[0] * grid[1], "attn_pool": 4}
    assert n == expected.get(kind, (grid[0] // 2) * (grid[1] // 2))


@pytest.mark.parametrize("family", ["siglip", "clip"])
@pytest.mark.parametrize(
    ("image_size", "patch_size", "kind"), [(32, 8, "mlp2"), (48, 8, "avg_pool"), (32, 16, "attn_pool")]
)
def test_encoder_and_connector_counts_match_the_model(family, image_size, patch_size, kind):
    model = VisionLanguageModel(
        tiny_text(), tiny_vlm("joint_decoder"), tiny_encoder(family, image_size, patch_size), tiny_connector(kind)
    )
    model.init_weights(0)
    tokens = model.visual_tokens(torch.randn(2, 3, image_size, image_size))
    assert tokens.shape == (2, model.n_visual, 32)


def test_avg_pool_refuses_a_grid_it_cannot_tile():
    with pytest.raises(ValueError, match=r"connector.pool_size=4 must divide both sides of the patch grid 6x8"):
        connector_tokens(ConnectorConfig(type="avg_pool", pool_size=4), (6, 8), 32)
    with pytest.raises(ValueError, match="connector.type='mean' is not allowed"):
        ConnectorConfig(type="mean")
    with pytest.raises(ValueError, match="encoder.image_size=30 must be a multiple of encoder.patch_size=8"):
        VisionEncoderConfig(image_size=30, patch_size=8)


@pytest.mark.parametrize("family", ["siglip", "clip"])
def test_encoder_from_save_pretrained_equals_transformers(family, tmp_path):
    """Check 5: features through our path (meta build, to_empty, init_weights loads the folder) equal the
    transformers model's own, and the processor comes from the same folder."""
    import transformers

    name = {"siglip": "Siglip", "clip": "CLIP"}[family]
    config = getattr(transformers, f"{name}VisionConfig")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    torch.manual_seed(1)
    reference = getattr(transformers, f"{name}VisionModel")(config).eval()
    reference.save_pretrained(tmp_path)
    processor = build_image_processor(tiny_encoder(family))
    processor.image_mean = [0.25, 0.5, 0.75]  # distinctive, so we know it was read back from the folder
    processor.save_pretrained(tmp_path)

    cfg = VisionEncoderConfig(pretrained_path=str(tmp_path))
    with torch.device("meta"):
        encoder = VisionEncoder(cfg)
    encoder.to_empty(device="cpu")
    encoder.init_weights(seed=123)  # the seed must not matter for a pretrained tower
    encoder.eval()
    pixels = torch.randn(2, 3, 32, 32)
    want = reference(pixel_values=pixels).last_hidden_state
    want = want[:, 1:] if family == "clip" else want  # LLaVA's "patch" features: CLIP's class token dropped
    torch.testing.assert_close(encoder(pixels), want, rtol=0, atol=0)
    assert encoder.family == family and encoder.grid == (4, 4)
    assert list(build_image_processor(cfg).image_mean) == [0.25, 0.5, 0.75]


def test_full_siglip_folder_loads_its_vision_tower(tmp_path):
    from transformers import SiglipConfig, SiglipModel

    config = SiglipConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=100),
    )  # fmt: skip
    torch.manual_seed(0)
    full = SiglipModel(config).eval()
    full.save_pretrained(tmp_path)
    encoder = VisionEncoder(VisionEncoderConfig(pretrained_path=str(tmp_path)))
    encoder.init_weights(0)
    pixels = torch.randn(1, 3, 32, 32)
    want = full.vision_model(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(encoder.eval()(pixels), want, rtol=0, atol=0)


def test_bad_pretrained_folder_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        VisionEncoder(VisionEncoderConfig(pretrained_path=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="model_type='llama'; supported"):
        VisionEncoder(VisionEncoderConfig(pretrained_path=str(tmp_path)))


# -- data -----------------------------------------------------------------------------------------


def test_three_formats_give_the_same_sixteen_pairs():
    jsonl = ImageTextDataset(str(IMAGES / "captions.jsonl"), "jsonl", "image", "caption")
    folder = ImageTextDataset(str(IMAGES), "imagefolder", text_field="text")
    parquet = ImageTextDataset(str(IMAGE_PARQUET), "parquet", "image", "text")
    assert len(jsonl) == len(folder) == len(parquet) == 16
    assert [r.caption for r in jsonl.records] == [r.caption for r in folder.records]
    assert sorted(r.caption for r in parquet.records) == sorted(r.caption for r in jsonl.records)
    item = jsonl[0]
    assert item["image"].mode == "RGB" and item["caption"].startswith("Studio portrait")
    grays = [i for i in range(16) if Image.open(jsonl.records[i].path).mode != "RGB"]
    assert grays and all(jsonl[i]["image"].mode == "RGB" for i in grays)  # grayscale photos converted


def test_missing_and_undecodable_images_are_reported(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    (tmp_path / "a.jsonl").write_text('{"image": "bad.png", "caption": "x"}\n{"image": "gone.png", "caption": "y"}\n')
    with pytest.raises(ImageDataError, match=r"1 image file\(s\) listed in .* do not exist: .*gone.png"):
        ImageTextDataset(str(tmp_path / "a.jsonl"))
    (tmp_path / "b.jsonl").write_text('{"image": "bad.png", "caption": "x"}\n')
    data = ImageTextDataset(str(tmp_path / "b.jsonl"))
    with pytest.raises(ImageDataError, match=r"cannot decode the image of .*b.jsonl:1"):
        data[0]
    with pytest.raises(ValueError, match="data.format='csv' is not allowed"):
        ImageTextDataset(str(tmp_path / "b.jsonl"), "csv")


def test_labels_are_the_next_token_on_text_only_with_eos():
    """Labels are shifted (so copying the current token cannot reach zero loss), EOS is the last label,
    padding is ignored."""
    tok = AutoTokenizer.from_pretrained(GPT2)
    collate = ImageTextCollator(tok, build_image_processor(tiny_encoder()), max_text_len=12)
    data = ImageTextDataset(str(IMAGES / "captions.jsonl"))
    short = {"image": data[0]["image"], "caption": "A cat."}
    batch = collate([data[1], short])
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["text_mask"]
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    assert ids.shape == (2, 12) and mask[1].sum() == len(tok.encode("A cat.")) + 1
    eos = tok.eos_token_id
    for row in range(2):
        n = int(mask[row].sum())
        assert ids[row, 0] == eos  # GPT-2's bos is <|endoftext|>
        assert torch.equal(labels[row, : n - 1], ids[row, 1:n])
        assert (labels[row, n:] == -100).all()
    assert labels[1, int(mask[1].sum()) - 1] == eos  # the short caption ends with EOS
    real = labels != -100
    # A model that copies the current token is wrong almost everywhere; the next-token oracle is right.
    copy = torch.nn.functional.one_hot(ids, 50257).float() * 30
    oracle = torch.nn.functional.one_hot(labels.clamp(min=0), 50257).float() * 30
    ce = lambda logits: torch.nn.functional.cross_entropy(logits[real], labels[real])  # noqa: E731
    assert (ids[real] == labels[real]).float().mean() < 0.1
    assert ce(copy) > 20 and ce(oracle) < 1e-6


# -- freezing -------------------------------------------------------------------------------------


def _model():
    model = VisionLanguageModel(tiny_text(), tiny_vlm("cross_attention"), tiny_encoder(), tiny_connector())
    model.init_weights(0)
    return model


def test_freeze_spec_components_patterns_and_eval_mode():
    model = _model().train()
    train = apply_freeze(
        model, FreezeSpec(encoder=True, backbone=True, trainable_patterns=["backbone.layers.*.cross_*"])
    )
    assert train and all(n.startswith("connector.") or ".cross_" in n for n in train)
    assert not model.encoder.training and model.backbone.training  # a frozen tower stays in eval mode
    model.train()
    assert not model.encoder.training
    apply_freeze(model, FreezeSpec(encoder=False))
    model.train()
    assert model.encoder.training
    with pytest.raises(ValueError, match=r"freeze pattern 'backbone.nothing\*' matches no parameter"):
        trainable_names(model, FreezeSpec(frozen_patterns=["backbone.nothing*"]))


def test_schedule_switches_by_step_and_optimizer_state_covers_every_ever_trainable_param():
    model = _model()
    first = FreezeSpec(encoder=True, backbone=True)
    schedule = FreezeSchedule(steps=[3], specs=[FreezeSpec(encoder=True)])
    assert [schedule.index_at(s) for s in (0, 2, 3, 10)] == [-1, -1, 0, 0]
    with pytest.raises(ValueError, match="strictly increasing"):
        FreezeSchedule(steps=[3, 3], specs=[first, first])
    apply_freeze(model, first)
    from kempnerforge.training.freeze import ever_trainable

    params = ever_trainable(model, [first, *schedule.specs])
    opt = torch.optim.AdamW(params, lr=1e-2)
    init_adamw_state(opt)
    assert len(opt.state) == len(params) == sum(1 for n, _ in model.named_parameters() if not n.startswith("encoder"))
    # Pre-created state steps exactly like lazily created state.
    p = torch.nn.Parameter(torch.randn(4))
    q = torch.nn.Parameter(p.detach().clone())
    a, b = torch.optim.AdamW([p], lr=0.1), torch.optim.AdamW([q], lr=0.1)
    init_adamw_state(b)
    for _ in range(3):
        for x, o in ((p, a), (q, b)):
            o.zero_grad()
            (x**2).sum().backward()
            o.step()
    torch.testing.assert_close(p, q, rtol=0, atol=0)
