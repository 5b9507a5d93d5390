"""Vision encoders: SigLIP and CLIP vision towers from ``transformers``, pretrained or random.

The tower is built on whatever device is current (the meta device under KempnerStrategy); its
weights are set by :meth:`VisionEncoder.init_weights`, after sharding, and no rank ever holds more than
its own shard: a pretrained tower reads only this rank's slices of the ``save_pretrained`` folder's
safetensors files (:class:`~kempnerforge.model.safetensors_shards.SafetensorsFolder`); a random tower
draws each tensor from HF's own init distribution for it (:func:`~kempnerforge.model.hf_init.hf_init_plan`)
with the counter-based sharded generator (:mod:`kempnerforge.model.init`), so it is the same on every mesh.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from kempnerforge.config.vision import ENCODER_FAMILIES, VisionEncoderConfig
from kempnerforge.errors import UserError
from kempnerforge.model.hf_init import apply_rule_, hf_init_plan
from kempnerforge.model.init import canonical_fqn
from kempnerforge.model.safetensors_shards import SafetensorsFolder

log = logging.getLogger(__name__)

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
    LLaVA's ``select_feature="patch"``), the tower's last hidden state or the one ``feature_layer`` names.

    Raises:
        UserError: ``feature_layer`` outside the tower's hidden states (at construction).

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
        self.feature_layer = cfg.feature_layer
        n_states = hf_config.num_hidden_layers + 1  # the embeddings, then each layer's output
        if self.feature_layer is not None and not -n_states <= self.feature_layer < n_states:
            raise UserError(
                "model.encoder.feature_layer",
                f"{self.feature_layer} is not a hidden state of this {hf_config.num_hidden_layers}-layer tower; "
                f"allowed: {-n_states} to {n_states - 1}, or null (the last hidden state)",
            )

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
        """Patch features (batch, n_patches, width) of ``pixel_values`` (batch, 3, H, W): the hidden state
        ``feature_layer`` names (LLaVA's ``vision_feature_layer``), or the tower's last hidden state."""
        if self.feature_layer is None:
            hidden = self.model(pixel_values=pixel_values).last_hidden_state
        else:  # transformers keeps every layer's output for this; the later layers still run, as in LLaVA
            hidden = self.model(pixel_values=pixel_values, output_hidden_states=True).hidden_states[self.feature_layer]
        return hidden[:, 1:] if self._drop_cls else hidden

    @torch.no_grad()
    def init_weights(self, seed: int = 0, prefix: str = "encoder") -> None:
        """Set every parameter and buffer of :attr:`model` in place, each rank writing only its own shard.

        Pretrained (``pretrained_path``): each tensor is read from the folder's safetensors files, only the
        elements this rank stores (keys as ``from_pretrained`` matches them: the name itself, or under the
        model's ``base_model_prefix`` as in a full SigLIP / CLIP checkpoint). What the folder lacks (non-persistent
        buffers such as ``position_ids``, or weights a warning lists, as ``from_pretrained`` initializes them) gets
        the random rule below. Bitwise equal to ``from_pretrained(path, dtype=float32)``.

        Random: HF's own init distribution for each tensor (:func:`~kempnerforge.model.hf_init.hf_init_plan`: e.g.
        SigLIP's xavier-uniform projections, LeCun-normal patch embedding, N(0, 1/width) positions), drawn from
        (seed, ``f"{prefix}.model.{name}"``) by the counter-based generator: the same weights on every mesh.

        Raises:
            FileNotFoundError: ``pretrained_path`` holds no safetensors weights.
            ValueError: a tensor in the folder has another shape than the model's, or the folder holds none of
                the model's weights (not this tower's checkpoint).
            UserError: a tensor the folder does not hold has an HF init with no counter-based version
                (``model.encoder.pretrained_path``), raised before any tensor is written.
        """
        plan = hf_init_plan(type(self.model), self.model.config)
        tensors = {canonical_fqn(n): t for n, t in (*self.model.named_parameters(), *self.model.named_buffers())}
        loaded: set[str] = set()
        if self.cfg.pretrained_path is not None:
            loaded = self._load_pretrained(tensors)
        unsupported = {
            n: plan[n].args.get("name") for n in tensors if n not in loaded and plan[n].kind == "unsupported"
        }
        if unsupported:  # before any tensor is written
            raise UserError(
                "model.encoder.pretrained_path",
                f"transformers initializes {sorted(unsupported)} with torch.nn.init.{sorted(set(unsupported.values()))}, "
                "which has no sharded counter-based version; give a pretrained folder that holds these tensors",
            )
        for name, tensor in tensors.items():
            if name not in loaded:
                apply_rule_(tensor, plan[name], f"{prefix}.model.{name}", seed)

    def _load_pretrained(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Read every tensor the folder holds into ``tensors`` (this rank's shard only); the names read."""
        prefix = getattr(self.model, "base_model_prefix", "")
        with SafetensorsFolder(self.cfg.pretrained_path) as folder:
            keys = folder.keys()
            found = {}
            for name in tensors:
                for key in (name, f"{prefix}.{name}" if prefix else None):
                    if key in keys:
                        found[name] = key
                        break
            if not found:
                raise ValueError(
                    f"encoder.pretrained_path={self.cfg.pretrained_path!r} holds none of the "
                    f"{type(self.model).__name__} weights (e.g. {next(iter(tensors))!r})."
                )
            for name, key in found.items():
                folder.read_shard_(tensors[name], key)
        params = {canonical_fqn(n) for n, _ in self.model.named_parameters()}
        missing = sorted(params - set(found))
        if missing:
            log.warning("encoder weights missing from %s, newly initialized: %s", self.cfg.pretrained_path, missing)
        return set(found)
