"""Issue 32, check 1: a VLM starts from a pretrained language model (``model.init_from``) and a pretrained vision tower
(``encoder.pretrained_path``), against ``transformers``.

Tiny random-weight HF folders (Llama with tied embeddings, Qwen 2 with q/k/v biases, a SigLIP vision tower), saved
with ``save_pretrained``. For each of the four archs, a text-only batch at step 0 gives the HF text model's logits
(joint_decoder and MoT: the text weights in every tower; cross_attention: zero gates; MoMa: every expert a copy of
the FFN, sparse upcycling, whose sigmoid gates scale the copies: with its 2 experts at capacity 2, every expert takes
every token, and routers set to zero here give each copy the gate 1/2, so the sum is the FFN: this checks where the
weights went; a MoMa from init_from in general starts near, not at, the text model). The joint_decoder's loss on an image-caption batch
equals that of a ``LlavaForConditionalGeneration`` assembled by hand from the same folders and our connector's
weights (SigLIP features before its post-layernorm: ``encoder.feature_layer=-1``, LLaVA's ``vision_feature_layer``).
A tiny DeepSeek-V3 folder (MLA, MoE) starts joint_decoder, cross_attention and (dense) MoMa at the HF text model; MoT
refuses MLA in one line.
"""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.vision import ConnectorConfig, VisionEncoderConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.errors import UserError
from kempnerforge.module import VisionLanguage
from tests.hf_folders import save_random

TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
VISION = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=8)  # fmt: skip  # a 4 x 4 patch grid: 16 visual tokens with mlp2
ARCHS = ("joint_decoder", "cross_attention", "mot", "moma")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{"llama": dir, "qwen2": dir, "siglip": dir}``."""
    import transformers as tf

    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": save_random(tf.LlamaForCausalLM, tf.LlamaConfig(**TEXT, tie_word_embeddings=True), root / "llama"),
        "qwen2": save_random(tf.Qwen2ForCausalLM, tf.Qwen2Config(**TEXT, tie_word_embeddings=False), root / "qwen2", 1),
        "siglip": save_random(tf.SiglipVisionModel, tf.SiglipVisionConfig(**VISION), root / "siglip", 2),
    }


def _vlm(folders, text: str, arch: str, **kw) -> VisionLanguage:
    vlm = VLMConfig(arch=arch, cross_attn_every=1, moma_experts_per_modality=2, moma_capacity_factor=2.0)
    module = VisionLanguage(
        vlm=vlm,
        encoder=VisionEncoderConfig(pretrained_path=str(folders["siglip"]), **kw),
        connector=ConnectorConfig(type="mlp2"),
        init_from=str(folders[text]),
    )
    module.configure_model()
    return module.eval()


def _ids(batch: int = 3, length: int = 11) -> torch.Tensor:
    return torch.randint(1, TEXT["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("text", ["llama", "qwen2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_text_only_logits_at_step_0_equal_the_hf_text_model(folders, text, arch):
    from transformers import AutoModelForCausalLM

    module = _vlm(folders, text, arch)
    for name, param in module.model.named_parameters():
        if name.endswith("router.weight"):  # MoMa: gates 1/2 (see the module docstring)
            param.data.zero_()
    hf = AutoModelForCausalLM.from_pretrained(folders[text], dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        ours, theirs = module(ids), hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert module.config.vocab_size == TEXT["vocab_size"] and module.config.dim == TEXT["hidden_size"]


def test_the_text_weights_are_read_into_every_place_that_starts_from_them(folders):
    from safetensors.torch import load_file

    disk = load_file(folders["llama"] / "model.safetensors")
    mot = _vlm(folders, "llama", "mot").model.backbone
    gate = disk["model.layers.1.mlp.gate_proj.weight"]
    assert torch.equal(mot.layers["1"].feed_forward["image"].w1.weight, gate)
    assert torch.equal(mot.layers["1"].feed_forward["text"].w1.weight, gate)
    moma = _vlm(folders, "llama", "moma").model.backbone
    experts = moma.layers["1"].feed_forward["image"].experts
    assert all(torch.equal(experts.w1[e], gate) for e in range(2))
    cross = _vlm(folders, "llama", "cross_attention").model.backbone.layers["0"]
    assert cross.cross_attention_gate.item() == 0 and cross.cross_ffn_gate.item() == 0


def _llava(folders, module: VisionLanguage):
    """``LlavaForConditionalGeneration`` from the Llama and SigLIP folders, with our connector as its projector."""
    import transformers as tf

    text = tf.LlamaForCausalLM.from_pretrained(folders["llama"], dtype=torch.float32)
    vision = tf.SiglipVisionModel.from_pretrained(folders["siglip"], dtype=torch.float32)
    config = tf.LlavaConfig(
        vision_config=vision.config, text_config=text.config, image_token_index=TEXT["vocab_size"] - 1,
        projector_hidden_act="gelu", vision_feature_layer=-1, vision_feature_select_strategy="full",
        image_seq_length=16, tie_word_embeddings=True,
    )  # fmt: skip
    llava = tf.LlavaForConditionalGeneration(config).eval()
    proj = module.model.connector.proj
    text_state = text.model.state_dict()
    state = {f"model.language_model.{k}": v for k, v in text_state.items()}
    state |= {f"model.vision_tower.{k}": v for k, v in vision.state_dict().items()}
    state |= {f"model.multi_modal_projector.linear_{i + 1}.{p}": getattr(proj[2 * i], p) for i in (0, 1)
              for p in ("weight", "bias")}  # fmt: skip
    state["lm_head.weight"] = text.lm_head.weight
    missing, unexpected = llava.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if k != "lm_head.weight"], (missing, unexpected)
    return llava


def test_joint_decoder_image_caption_loss_equals_hand_assembled_llava(folders):
    module = _vlm(folders, "llama", "joint_decoder", feature_layer=-1)
    llava = _llava(folders, module)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    ids = _ids(2, 9)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # ours: labels[t] follows ids[t]
    batch = {"input_ids": ids, "labels": labels, "pixel_values": pixels}
    with torch.no_grad():
        loss_sum, n_targets = module._validation_loss_sum(batch)  # the training step's loss path
        ours = loss_sum / n_targets
        image = torch.full((2, 16), llava.config.image_token_index)
        hf_labels = torch.cat([torch.full((2, 17), -100), ids[:, 1:]], dim=1)  # HF shifts: position t predicts t + 1
        theirs = llava(input_ids=torch.cat([image, ids], 1), pixel_values=pixels, labels=hf_labels).loss
    assert abs(ours.item() - theirs.item()) <= 1e-5, (ours.item(), theirs.item())


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """Tiny random DeepseekV3ForCausalLM folders (tests/deepseek_tiny.py: MLA with a query latent and interleaved
    RoPE): ``moe`` (1 dense + 2 group-limited sigmoid MoE layers, a shared expert) and ``dense`` (3 dense layers)."""
    from tests.deepseek_tiny import save_tiny_deepseek_v3

    root = tmp_path_factory.mktemp("dsv3")
    return {
        "moe": save_tiny_deepseek_v3(root / "moe"),
        "dense": save_tiny_deepseek_v3(root / "dense", 1, first_k_dense_replace=3),
    }


@pytest.mark.parametrize(("arch", "folder"), [("joint_decoder", "moe"), ("cross_attention", "moe"), ("moma", "dense")])
def test_a_deepseek_v3_folder_starts_the_mla_archs_at_the_hf_text_model(folders, deepseek, arch, folder):
    """Issue 32 item 2, MLA backbones: a DeepSeek-V3 folder as ``init_from`` (MLA, and for joint_decoder and
    cross_attention its MoE layers; MoMa takes dense FFNs, so a dense DeepSeek-V3) gives the HF text model's logits at
    step 0 within 1e-5 (MoMa's routers zeroed as above)."""
    from transformers import AutoModelForCausalLM

    folders = {**folders, "ds": deepseek[folder]}
    module = _vlm(folders, "ds", arch)
    assert module.config.attention == "mla" and (module.config.num_experts > 0) == (folder == "moe")
    for name, param in module.model.named_parameters():
        if name.endswith("router.weight"):
            param.data.zero_()
    hf = AutoModelForCausalLM.from_pretrained(deepseek[folder], dtype=torch.float32).eval()
    ids = torch.randint(2, 128, (3, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = module(ids), hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_mot_refuses_an_mla_or_moe_folder_in_one_line(deepseek):
    for folder in ("dense", "moe"):
        with pytest.raises(UserError, match=r"has ModelConfig.attention='mla', not taken by vlm.arch='mot'") as err:
            VisionLanguage(vlm=VLMConfig(arch="mot"), init_from=str(deepseek[folder]))
        assert err.value.field == "model.init_from" and str(err.value).startswith(f"init_from={deepseek[folder]} ")


def test_a_feature_layer_outside_the_tower_is_refused(folders):
    with pytest.raises(UserError, match="allowed: -3 to 2") as err:
        _vlm(folders, "llama", "joint_decoder", feature_layer=3)
    assert err.value.field == "model.encoder.feature_layer"
