"""A joint_decoder VLM checkpoint as Hugging Face's LLaVA layout (``LlavaForConditionalGeneration``), which
transformers, lmms-eval and vLLM read.

The mapping (Liu et al., arXiv:2304.08485 / 2310.03744; transformers' ``modeling_llava``):

- text backbone -> ``model.language_model.*`` and ``lm_head`` through the text family's converter (Llama, Qwen 2 /
  3, ...: :mod:`~kempnerforge.checkpoint.hf_families`);
- vision tower (SigLIP or CLIP) -> ``model.vision_tower.*`` unchanged; our ``encoder.feature_layer`` is LLaVA's
  ``vision_feature_layer`` (CLIP's default, the last hidden state, is -1; SigLIP's default adds its post-layernorm,
  which LLaVA never applies, so SigLIP needs an explicit ``feature_layer``); CLIP's class token is dropped on both
  sides (``vision_feature_select_strategy="default"``; SigLIP has none: ``"full"``);
- the ``mlp2`` connector -> ``model.multi_modal_projector.linear_1 / linear_2`` (GELU between, biases).
- LLaVA marks where the image goes with an image token in ``input_ids`` (expanded to ``image_seq_length``
  positions by its processor). Our model prepends the visual tokens and has no such token: the tokenizer gets
  ``<image>`` if it lacks one, and when its id falls outside our vocabulary, the embedding and head grow by one
  zero row (the token's embedding is replaced by the image features; its logit is 0, never a target).

Connectors LLaVA cannot express (``linear``, ``avg_pool``, ``attn_pool``) and the other archs are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kempnerforge.config.vision import ConnectorConfig, VisionEncoderConfig
from kempnerforge.config.vlm import VLMConfig

#: The placeholder LLaVA's processor expands into the image's positions.
IMAGE_TOKEN = "<image>"
#: LLaVA's ``vision_feature_select_strategy`` for our towers: CLIP's class token dropped, SigLIP has none.
FEATURE_SELECT = {"siglip": "full", "clip": "default"}


def check_llava_exportable(vlm: VLMConfig, encoder: VisionEncoderConfig, connector: ConnectorConfig) -> None:
    """The VLM has a LLaVA equivalent.

    Raises:
        ValueError: an arch other than ``joint_decoder``, a connector other than ``mlp2``, or a SigLIP tower read at
            its ``last_hidden_state`` (``feature_layer=None``); each names the field and what is allowed.
    """
    from kempnerforge.model.vision import encoder_family

    if vlm.arch != "joint_decoder":
        raise ValueError(
            f"vlm.arch={vlm.arch!r} has no Hugging Face LLaVA equivalent; allowed for export: joint_decoder"
        )
    if connector.type != "mlp2":
        raise ValueError(
            f"connector.type={connector.type!r} has no LLaVA projector equivalent (Linear -> GELU -> Linear); "
            "allowed for export: mlp2"
        )
    if encoder.feature_layer is None and encoder_family(encoder) == "siglip":
        raise ValueError(
            "encoder.feature_layer=null reads SigLIP after its post-layernorm, which LLaVA never applies; allowed "
            "for export: a model trained with an explicit feature_layer (-1: the last layer)"
        )


def llava_config(text_hf_config, encoder: VisionEncoderConfig, n_visual: int, image_token_id: int, tied: bool):
    """The ``LlavaConfig`` of a joint_decoder VLM (see the module docstring for each field)."""
    from transformers import LlavaConfig

    from kempnerforge.model.vision import encoder_family, hf_vision_config

    clip = encoder_family(encoder) == "clip"
    return LlavaConfig(
        vision_config=hf_vision_config(encoder),
        text_config=text_hf_config,
        image_token_id=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_layer=-1 if encoder.feature_layer is None else encoder.feature_layer,
        vision_feature_select_strategy=FEATURE_SELECT["clip" if clip else "siglip"],
        image_seq_length=n_visual,
        multimodal_projector_bias=True,
        tie_word_embeddings=tied,
    )


def llava_state_dict(
    text_hf: dict[str, torch.Tensor], vlm_sd: dict[str, torch.Tensor], vocab_rows: int
) -> dict[str, torch.Tensor]:
    """LLaVA's state dict from the text family's HF state dict ``text_hf`` (``model.*``, ``lm_head.weight``) and
    our VLM state dict ``vlm_sd`` (``encoder.model.*``, ``connector.proj.{0,2}.*``); the embedding and head padded
    with zero rows to ``vocab_rows``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in text_hf.items():
        if key in ("model.embed_tokens.weight", "lm_head.weight") and value.shape[0] < vocab_rows:
            value = torch.cat([value, value.new_zeros(vocab_rows - value.shape[0], value.shape[1])])
        out[f"model.language_model.{key.removeprefix('model.')}" if key.startswith("model.") else key] = value
    for key, value in vlm_sd.items():
        if key.startswith("encoder.model."):
            out[f"model.vision_tower.{key.removeprefix('encoder.model.')}"] = value
        elif key.startswith("connector.proj."):
            index, param = key.removeprefix("connector.proj.").split(".")
            out[f"model.multi_modal_projector.linear_{int(index) // 2 + 1}.{param}"] = value
    return out


def llava_tokenizer(tokenizer_dir: str | Path) -> tuple[Any, int]:
    """The tokenizer of ``tokenizer_dir`` with :data:`IMAGE_TOKEN` added if missing, and that token's id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    return tokenizer, int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))


def llava_processor(tokenizer, encoder: VisionEncoderConfig, llava_cfg):
    """``LlavaProcessor`` (the encoder's image processor, ``tokenizer``, the tokenizer's chat template) that expands
    one :data:`IMAGE_TOKEN` into ``image_seq_length`` positions."""
    from transformers import LlavaProcessor

    from kempnerforge.model.vision import build_image_processor

    clip = llava_cfg.vision_feature_select_strategy == "default"
    return LlavaProcessor(
        image_processor=build_image_processor(encoder),
        tokenizer=tokenizer,
        patch_size=llava_cfg.vision_config.patch_size,
        vision_feature_select_strategy=llava_cfg.vision_feature_select_strategy,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1 if clip else 0,
        chat_template=getattr(tokenizer, "chat_template", None),
    )


def vlm_configs_from_llava(hf_config, tower_dir: str | Path) -> tuple[VLMConfig, VisionEncoderConfig, ConnectorConfig]:
    """Our arch, encoder and connector configs for a ``LlavaConfig`` whose vision tower is saved at ``tower_dir``.

    Raises:
        ValueError: a LLaVA our joint_decoder cannot express: a projector activation other than GELU or without
            biases, a vision tower other than SigLIP / CLIP, several feature layers, or a feature selection other
            than CLIP's ``default`` / SigLIP's ``full``.
    """
    vision_type = hf_config.vision_config.model_type
    family = {"siglip_vision_model": "siglip", "clip_vision_model": "clip"}.get(vision_type)
    if family is None:
        raise ValueError(
            f"LLaVA vision_config.model_type={vision_type!r} has no kempnerforge encoder; allowed: "
            "siglip_vision_model, clip_vision_model"
        )
    for field, value, allowed in (
        ("projector_hidden_act", hf_config.projector_hidden_act, "gelu"),
        ("multimodal_projector_bias", getattr(hf_config, "multimodal_projector_bias", True), True),
        ("vision_feature_select_strategy", hf_config.vision_feature_select_strategy, FEATURE_SELECT[family]),
    ):
        if value != allowed:
            raise ValueError(f"LLaVA {field}={value!r} has no kempnerforge equivalent; allowed: {allowed!r}")
    if not isinstance(hf_config.vision_feature_layer, int):
        raise ValueError(
            f"LLaVA vision_feature_layer={hf_config.vision_feature_layer!r} (several layers) has no kempnerforge "
            "equivalent; allowed: one layer index"
        )
    encoder = VisionEncoderConfig(pretrained_path=str(tower_dir), feature_layer=hf_config.vision_feature_layer)
    return VLMConfig(arch="joint_decoder"), encoder, ConnectorConfig(type="mlp2")


def split_llava_state_dict(sd: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """A LLaVA state dict (transformers 5's in-memory keys) as (the text model's ``*ForCausalLM`` keys, the vision
    tower's own keys, our connector's keys): :func:`llava_state_dict` backwards."""
    text, tower, connector = {}, {}, {}
    for key, value in sd.items():
        if key.startswith("model.language_model."):
            text[f"model.{key.removeprefix('model.language_model.')}"] = value
        elif key == "lm_head.weight":
            text[key] = value
        elif key.startswith("model.vision_tower."):
            tower[key.removeprefix("model.vision_tower.")] = value
        elif key.startswith("model.multi_modal_projector.linear_"):
            index, param = key.removeprefix("model.multi_modal_projector.linear_").split(".")
            connector[f"proj.{2 * (int(index) - 1)}.{param}"] = value
        else:
            raise KeyError(f"LLaVA tensor {key!r} has no kempnerforge counterpart")
    return text, tower, connector
