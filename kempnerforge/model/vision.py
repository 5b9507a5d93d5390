"""Vision encoders: SigLIP and CLIP vision towers from ``transformers``, pretrained or random.

The tower is built on whatever device is current (the meta device under KempnerStrategy); its
weights are set by :meth:`VisionEncoder.init_weights`, which loads the ``save_pretrained`` folder
again (pretrained) or draws HF's own init from a seeded CPU generator (random). Either way the full
tensors are built on CPU and each rank copies only its shard (:func:`kempnerforge.model.init.copy_full_`),
so the weights survive meta-device construction, FSDP2 sharding and ``to_empty`` unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from kempnerforge.config.vision import ENCODER_FAMILIES, VisionEncoderConfig
from kempnerforge.model.init import copy_full_

#: family -> (model_type values in a config.json, transformers vision config / model / image processor names).
_FAMILIES: dict[str, tuple[tuple[str, ...], str, str, str]] = {
    "siglip": (("siglip", "siglip_vision_model"), "SiglipVisionConfig", "SiglipVisionModel", "SiglipImageProcessor"),
    "clip": (("clip", "clip_vision_model"), "CLIPVisionConfig", "CLIPVisionModel", "CLIPImageProcessor"),
}


def _transformers_class(name: str) -> type:
    import transformers

    return getattr(transformers, name)


def encoder_family(cfg: VisionEncoderConfig) -> str:
    """The family of the tower ``cfg`` describes: read from ``config.json`` of ``pretrained_path``, else ``cfg.family``.

    Raises:
        FileNotFoundError: ``pretrained_path`` has no ``config.json``.
        ValueError: its ``model_type`` is not a supported vision tower (names the allowed ones).
    """
    if cfg.pretrained_path is None:
        return cfg.family
    path = Path(cfg.pretrained_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"encoder.pretrained_path={cfg.pretrained_path!r} has no config.json (a transformers save_pretrained folder)."
        )
    model_type = json.loads(path.read_text()).get("model_type")
    for family, (types, *_rest) in _FAMILIES.items():
        if model_type in types:
            return family
    allowed = [t for types, *_ in _FAMILIES.values() for t in types]
    raise ValueError(
        f"encoder.pretrained_path={cfg.pretrained_path!r} holds model_type={model_type!r}; supported: {allowed} "
        f"(families {list(ENCODER_FAMILIES)})."
    )


def hf_vision_config(cfg: VisionEncoderConfig):
    """The ``transformers`` vision config (``SiglipVisionConfig`` / ``CLIPVisionConfig``) for ``cfg``.

    From ``pretrained_path`` (a full SigLIP/CLIP config gives its ``vision_config``), else from the size fields.
    """
    family = encoder_family(cfg)
    config_cls = _transformers_class(_FAMILIES[family][1])
    if cfg.pretrained_path is not None:
        return config_cls.from_pretrained(cfg.pretrained_path)
    kwargs = dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
    )
    if family == "siglip":
        kwargs["vision_use_head"] = False  # the attention-pooling head is for contrastive pretraining only
    return config_cls(**kwargs)


def build_image_processor(cfg: VisionEncoderConfig):
    """The image processor that matches the tower (resize to ``image_size``, rescale, normalize).

    From ``pretrained_path`` (its ``preprocessor_config.json``) when the folder has one, else the
    family's processor for ``image_size`` with the family's standard mean / std (SigLIP: 0.5 / 0.5;
    CLIP: OpenAI CLIP statistics). Its output ``pixel_values`` are (batch, 3, image_size, image_size) fp32.
    """
    family = encoder_family(cfg)
    processor_cls = _transformers_class(_FAMILIES[family][3])
    if cfg.pretrained_path is not None and (Path(cfg.pretrained_path) / "preprocessor_config.json").is_file():
        return processor_cls.from_pretrained(cfg.pretrained_path)
    side = hf_vision_config(cfg).image_size
    if family == "clip":
        return processor_cls(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return processor_cls(size={"height": side, "width": side})


class VisionEncoder(nn.Module):
    """A ``transformers`` vision tower returning patch features.

    Shapes: forward(pixel_values (batch, 3, H, W)) -> (batch, n_patches, width) with
    ``n_patches = grid[0] * grid[1]`` in row-major patch order (CLIP's class token is dropped, as
    LLaVA's ``select_feature="patch"``), the tower's last hidden state.

    When every parameter is frozen (``requires_grad=False``) the tower stays in eval mode whatever
    ``train()`` is called with (Lightning calls ``model.train()`` at the start of fit).

    Attributes:
        model: the ``SiglipVisionModel`` / ``CLIPVisionModel``.
        width: feature width (``hidden_size``).
        grid: (rows, cols) of the patch grid.
        layers: the tower's encoder layers (``nn.ModuleList``), one FSDP2 unit each.
    """

    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.family = encoder_family(cfg)
        hf_config = hf_vision_config(cfg)
        self.model = _transformers_class(_FAMILIES[self.family][2])(hf_config)
        self.width = hf_config.hidden_size
        side = hf_config.image_size // hf_config.patch_size
        self.grid = (side, side)
        self._drop_cls = self.family == "clip"

    @property
    def layers(self) -> nn.ModuleList:
        """The tower's transformer layers (``...encoder.layers``)."""
        found = [m for n, m in self.model.named_modules() if n.endswith("encoder.layers")]
        if len(found) != 1 or not isinstance(found[0], nn.ModuleList):
            raise RuntimeError(f"{type(self.model).__name__} has no single encoder.layers ModuleList.")
        return found[0]

    @property
    def frozen(self) -> bool:
        """True when no parameter of the tower is trainable."""
        return not any(p.requires_grad for p in self.parameters())

    def train(self, mode: bool = True) -> VisionEncoder:
        """``nn.Module.train``, except that a frozen tower always stays in eval mode."""
        return super().train(mode and not self.frozen)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Patch features (batch, n_patches, width) of ``pixel_values`` (batch, 3, H, W)."""
        hidden = self.model(pixel_values=pixel_values).last_hidden_state
        return hidden[:, 1:] if self._drop_cls else hidden

    def reference_state(self, seed: int) -> dict[str, torch.Tensor]:
        """Full CPU tensors for every parameter and buffer of :attr:`model`, by FQN.

        Pretrained: loaded again from ``pretrained_path`` (``from_pretrained``). Random: HF's own
        init of a CPU copy under ``torch.manual_seed(seed)`` in a forked RNG (the global RNG is left
        untouched), identical on every rank.
        """
        model_cls = type(self.model)
        if self.cfg.pretrained_path is not None:
            ref = model_cls.from_pretrained(self.cfg.pretrained_path, dtype=torch.float32)
        else:
            with torch.random.fork_rng(devices=[]), torch.device("cpu"):
                torch.manual_seed(seed)
                ref = model_cls(self.model.config)
        return {**dict(ref.named_parameters()), **dict(ref.named_buffers())}

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Set every parameter and buffer from :meth:`reference_state` (sharded copies for DTensors).

        Raises:
            KeyError: a parameter or buffer of the tower is missing from the reference (names it).
        """
        ref = self.reference_state(seed)
        tensors = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        missing = sorted(set(tensors) - set(ref))
        if missing:
            raise KeyError(f"vision encoder reference has no values for {missing}")
        for name, tensor in tensors.items():
            copy_full_(tensor, ref[name].detach().to(torch.float32) if tensor.is_floating_point() else ref[name])
