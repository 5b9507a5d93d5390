"""Vision side of a VLM: the image encoder (a ``transformers`` vision tower) and the connector.

Both dataclasses validate their fields in ``__post_init__``, before anything is allocated. Paths are
only checked when the model is built (a cluster recipe may name a folder that exists only there).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Allowed ``VisionEncoderConfig.family`` values: the ``transformers`` vision towers supported.
#: Fixed-resolution SigLIP 2 checkpoints (e.g. ``google/siglip2-so400m-patch14-384``) are
#: ``model_type: siglip`` and load as ``siglip``.
ENCODER_FAMILIES: tuple[str, ...] = ("siglip", "clip")

#: Allowed ``ConnectorConfig.type`` values.
CONNECTOR_TYPES: tuple[str, ...] = ("mlp2", "linear", "avg_pool", "attn_pool")


@dataclass
class VisionEncoderConfig:
    """A SigLIP or CLIP vision tower from ``transformers``: pretrained from a local folder or random.

    With ``pretrained_path`` the architecture, weights and image processor come from that
    ``save_pretrained`` folder (a vision model or a full SigLIP/CLIP model; ``family`` and the size
    fields below are then ignored). Without it a randomly initialized tower is built from the size
    fields (tests, smoke runs); nothing is ever downloaded.
    """

    family: str = "siglip"
    """Vision tower type without ``pretrained_path``: one of :data:`ENCODER_FAMILIES`."""
    pretrained_path: str | None = None
    """Local ``save_pretrained`` folder (config.json, safetensors, preprocessor_config.json), or None (random)."""
    image_size: int = 224
    """Input side, pixels (square images after the processor's resize)."""
    patch_size: int = 16
    """Patch side, pixels; ``image_size`` must be a multiple of it."""
    hidden_size: int = 768
    """Width of the vision tower (the connector maps it to the text ``dim``)."""
    n_layers: int = 12
    """Transformer layers of the vision tower."""
    n_heads: int = 12
    """Attention heads of the vision tower (must divide ``hidden_size``)."""
    intermediate_size: int = 3072
    """MLP hidden width of the vision tower."""
    feature_layer: int | None = None
    """Which hidden state the connector reads, as LLaVA's ``vision_feature_layer``: an index into the tower's
    ``hidden_states`` (0 the patch embeddings, -1 the last layer's output before SigLIP's post-layernorm, -2 the
    penultimate layer, LLaVA-1.5's choice); None: the tower's ``last_hidden_state`` (SigLIP: after its
    post-layernorm; CLIP: the last layer's output, as -1)."""

    def __post_init__(self) -> None:
        if self.pretrained_path is not None:
            return
        if self.family not in ENCODER_FAMILIES:
            raise ValueError(f"encoder.family={self.family!r} is not allowed; choose one of {list(ENCODER_FAMILIES)}.")
        for name in ("image_size", "patch_size", "hidden_size", "n_layers", "n_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"encoder.{name}={getattr(self, name)} must be >= 1.")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"encoder.image_size={self.image_size} must be a multiple of encoder.patch_size={self.patch_size}."
            )
        if self.hidden_size % self.n_heads:
            raise ValueError(f"encoder.n_heads={self.n_heads} must divide encoder.hidden_size={self.hidden_size}.")


@dataclass
class ConnectorConfig:
    """How patch features (batch, n_patches, encoder width) become visual tokens (batch, n_visual, dim).

    - ``mlp2``: Linear -> GELU -> Linear per patch (LLaVA-1.5, arXiv:2310.03744); n_visual = n_patches.
    - ``linear``: one Linear per patch (LLaVA, arXiv:2304.08485); n_visual = n_patches.
    - ``avg_pool``: average pooling of the patch grid with a ``pool_size`` window and stride, then the
      2-layer MLP; n_visual = (rows // pool_size) * (cols // pool_size). The grid sides must be
      multiples of ``pool_size``.
    - ``attn_pool``: ``n_queries`` learned queries cross-attend to the patches (Perceiver-resampler /
      Q-Former style pooling, Flamingo arXiv:2204.14198), then the 2-layer MLP; n_visual = n_queries.
    """

    type: str = "mlp2"
    """One of :data:`CONNECTOR_TYPES`."""
    pool_size: int = 2
    """avg_pool: window and stride over the patch grid (>= 1)."""
    n_queries: int = 16
    """attn_pool: learned queries, the number of visual tokens (>= 1)."""
    n_heads: int = 4
    """attn_pool: attention heads of the pooling (must divide the encoder width)."""

    def __post_init__(self) -> None:
        if self.type not in CONNECTOR_TYPES:
            raise ValueError(f"connector.type={self.type!r} is not allowed; choose one of {list(CONNECTOR_TYPES)}.")
        for name in ("pool_size", "n_queries", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"connector.{name}={getattr(self, name)} must be >= 1.")
