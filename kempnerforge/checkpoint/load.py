"""Load a kempnerforge DCP checkpoint into a plain, unsharded model on one device, without a process group.

Inference, export and evaluation tools run in one process: no ``init_process_group``, whatever world
size and mesh (FSDP2, TP, EP) the checkpoint was saved with. ``torch.distributed.checkpoint.load``
runs without any collective in its ``no_dist`` mode and reads each
requested tensor whole from whichever shards hold its pieces, as ``dcp_to_torch_save`` does, but
only the model's keys: optimizer moments are never read. One exception: a Schedule-Free run's
checkpoint holds the training point ``y``, so its ``z`` sequence is read too and the tools get the
averaged weights ``x`` that Schedule-Free evaluates (:func:`schedule_free_eval_weights_`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from kempnerforge.checkpoint.compat import with_legacy_fields
from kempnerforge.checkpoint.dcp_io import META_FILE, DCPCheckpointIO
from kempnerforge.config.model import ModelConfig
from kempnerforge.model.rope import model_rope_tables
from kempnerforge.model.transformer import Transformer

#: Prefix of the model's keys in a checkpoint: Lightning's ``state_dict`` of ``CausalLM`` holds ``model.*``.
MODEL_PREFIX = "state_dict.model."


#: ``meta.pt`` key of an imported checkpoint's tokenizer folder (the HF folder it came from, when it held one).
TOKENIZER_KEY = "tokenizer"


@dataclass
class LoadedCheckpoint:
    """A model restored from a checkpoint, with what the tools need around it.

    Attributes:
        model: the :class:`Transformer` in eval mode, plain tensors on the requested device/dtype.
        config: its :class:`ModelConfig` (from the checkpoint's hyperparameters).
        path: the resolved checkpoint directory.
        meta: the checkpoint's ``meta.pt`` (Lightning metadata: hyperparameters, loops, ...).
    """

    model: Transformer
    config: ModelConfig
    path: Path
    meta: dict[str, Any]

    @property
    def tokenizer(self) -> str | None:
        """The local tokenizer directory the training data was prepared with, when the run recorded one (or, for a
        ``kforge convert hf-to-dcp`` import, the HF folder's tokenizer: :data:`TOKENIZER_KEY`)."""
        data = self.meta.get("datamodule_hyper_parameters") or {}
        return data.get("tokenizer") or self.meta.get(TOKENIZER_KEY)


def model_config_from_meta(meta: dict[str, Any], path: Path) -> ModelConfig:
    """The :class:`ModelConfig` stored in a checkpoint's hyperparameters (``CausalLM(config=...)``).

    Raises:
        ValueError: the checkpoint has no ``hyper_parameters.config`` (not written by ``CausalLM`` or
            ``VisionLanguage``), or holds unknown config fields.
    """
    hparams = meta.get("hyper_parameters") or {}
    config = hparams.get("config")
    if not isinstance(config, dict):
        raise ValueError(
            f"{path}: no hyper_parameters['config'] in {META_FILE}; only checkpoints of "
            "kempnerforge.module.CausalLM (decoder LLM, dense or MoE) or VisionLanguage can be loaded here."
        )
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"{path}: checkpoint config has fields {unknown} that ModelConfig does not know")
    return ModelConfig(**with_legacy_fields(config))  # a checkpoint older than the fused projections: unfused


def build_model(config: ModelConfig, device: torch.device | str = "cpu") -> Transformer:
    """An uninitialized :class:`Transformer` on ``device`` (meta-built, then ``to_empty``) with its RoPE
    tables and weight tying in place: ready to receive a state dict, nothing drawn at random."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    model.tie_weights()
    cos, sin = model_rope_tables(config, "cpu")
    with torch.no_grad():
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    return model


def resolve_and_verify(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory ``path`` names (a checkpoint or the folder holding ``latest``) and its ``meta.pt``,
    after checking its files without reading a tensor (:func:`~kempnerforge.checkpoint.verify.verify_checkpoint`:
    ``.metadata`` and ``meta.pt`` against their checksums, the shards' sizes), and every rank's state file against
    its checksum (small files; a tool refuses a checkpoint a resume would refuse). The shards read are checked as
    they are read (:func:`load_model_state`). A checkpoint without checksums logs one warning.

    Raises:
        CheckpointError: missing or incomplete (:meth:`DCPCheckpointIO.resolve`).
        CorruptCheckpointError: a file that fails its checksum, a missing or truncated shard, an unreadable
            ``meta.pt`` or rank file (names it).
    """
    from kempnerforge.checkpoint.checksum import Manifests
    from kempnerforge.checkpoint.layout import rank_file
    from kempnerforge.checkpoint.verify import verify_checkpoint

    resolved = DCPCheckpointIO().resolve(path)
    meta = verify_checkpoint(resolved)
    manifests = Manifests(resolved)
    for rank in range(int(meta.get("world_size", 1))):
        manifests.check(rank_file(resolved, rank).name)
    return resolved, meta


def load_checkpoint_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> LoadedCheckpoint:
    """Restore the model of a kempnerforge checkpoint in this process, without a process group.

    Args:
        path: a checkpoint directory or the folder holding ``latest`` (as ``kforge fit --ckpt_path``).
        device: where the model lives.
        dtype: cast floating parameters to this dtype after loading (None: as saved, fp32 in training).

    Raises:
        CheckpointError: incomplete or missing checkpoint (:meth:`DCPCheckpointIO.resolve`); its subclass
            CorruptCheckpointError for a missing or truncated file (:func:`resolve_and_verify`).
        ValueError: no model config in the checkpoint (:func:`model_config_from_meta`).
        RuntimeError: DCP misses a model key or a shape differs.
    """
    resolved, meta = resolve_and_verify(path)
    config = model_config_from_meta(meta, resolved)
    model = build_model(config, device)
    load_model_state(model, resolved, "output.weight" if config.tie_embeddings else None, meta)
    if dtype is not None:
        model.to(dtype=dtype)
        model.rope_cos.data, model.rope_sin.data = model.rope_cos.float(), model.rope_sin.float()
    return LoadedCheckpoint(model.eval(), config, resolved, meta)


def load_model_state(
    model: torch.nn.Module, resolved: Path, tied_head: str | None = None, meta: dict[str, Any] | None = None
) -> None:
    """Fill ``model`` (plain tensors) with the checkpoint's ``state_dict.model.*`` entries, no collectives.

    Args:
        model: the module Lightning's ``model`` attribute held when the checkpoint was saved.
        resolved: the checkpoint directory.
        tied_head: FQN of an output head tied to the embedding (saved once, under the embedding).
        meta: the checkpoint's ``meta.pt`` when the caller already read it (None: read here if needed).

    Raises:
        RuntimeError: a key is missing from the checkpoint or a shape differs.
    """
    # Nested like the saved dict, so DCP's flattened keys ("state_dict.model.<fqn>") line up.
    own = {k: v for k, v in model.state_dict().items() if k != tied_head}
    state = {"state_dict": {f"model.{k}": v for k, v in own.items()}}
    _read(state, resolved)
    loaded = {key.removeprefix("model."): tensor for key, tensor in state["state_dict"].items()}
    if tied_head is not None:
        loaded[tied_head] = loaded[tied_head.replace("output.weight", "tok_embeddings.weight")]
    model.load_state_dict(loaded, strict=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    schedule_free_eval_weights_(model, resolved, meta)


def _read(state: dict[str, Any], resolved: Path) -> None:
    """``dcp.load`` without collectives (even if a group exists), each shard file read checked against its checksum.

    Raises:
        CorruptCheckpointError: a file read fails its checksum or cannot be read (names it).
    """
    from torch.distributed.checkpoint.api import CheckpointException

    from kempnerforge.checkpoint.errors import CheckpointError
    from kempnerforge.checkpoint.verify import NamingFileSystemReader, first_failure

    try:
        # Whole files, as before: a tool refuses a checkpoint a resume would refuse (its optimizer bytes included).
        dcp.load(state, storage_reader=NamingFileSystemReader(resolved, whole_files=True), no_dist=True)
    except CheckpointException as err:
        inner = first_failure(err)
        if isinstance(inner, CheckpointError):
            raise inner from err
        raise


@torch.no_grad()
def schedule_free_eval_weights_(model: torch.nn.Module, resolved: Path, meta: dict[str, Any] | None = None) -> bool:
    """Turn a Schedule-Free checkpoint's training weights ``y`` into the averaged weights ``x``, in place.

    Schedule-Free AdamW (Defazio et al. 2024, arXiv:2405.15682; the ``schedulefree`` package) trains at
    ``y = (1 - beta1) z + beta1 x`` and evaluates ``x``; Lightning checkpoints are written in train mode,
    so the saved model is ``y``. This applies the package's own ``eval()`` step to every parameter the
    optimizer held (``y.lerp_(z, 1 - 1 / beta1)``, bitwise what validation sees); frozen parameters and
    parameters saved in eval mode (``train_mode`` False) stay as saved. Other optimizers: no-op.

    Args:
        model: the loaded model (plain tensors), FQNs as under the LightningModule's ``model``.
        resolved: the checkpoint directory.
        meta: its ``meta.pt`` contents (None: read from ``resolved``).

    Returns:
        True when the weights were averaged.
    """
    if meta is None:
        from kempnerforge.checkpoint.verify import verify_checkpoint

        meta = verify_checkpoint(resolved, warn=False)  # meta.pt checked against its checksum
    optimizer = (meta.get("hyper_parameters") or {}).get("optimizer") or {}
    if optimizer.get("name") != "schedule_free_adamw":
        return False
    saved = dcp.FileSystemReader(resolved).read_metadata().state_dict_metadata  # checked by verify_checkpoint
    params = {n: p for n, p in model.named_parameters() if f"optimizer_0.state.model.{n}.z" in saved}
    state = {
        "optimizer_0": {
            **{f"state.model.{n}.z": torch.empty_like(p) for n, p in params.items()},
            **{f"param_groups.model.{n}.train_mode": True for n in params},
            **{f"param_groups.model.{n}.betas": (0.0, 0.0) for n in params},
        }
    }
    _read(state, resolved)
    loaded = state["optimizer_0"]
    for name, param in params.items():
        if loaded[f"param_groups.model.{name}.train_mode"]:
            beta1 = loaded[f"param_groups.model.{name}.betas"][0]
            param.lerp_(loaded[f"state.model.{name}.z"], 1 - 1 / beta1)
    return True


def is_vlm_checkpoint(path: str | Path) -> bool:
    """True when the checkpoint was written by :class:`kempnerforge.module.VisionLanguage`."""
    resolved, meta = resolve_and_verify(path)
    return isinstance((meta.get("hyper_parameters") or {}).get("vlm"), dict)


def load_vlm_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> LoadedCheckpoint:
    """Restore a :class:`~kempnerforge.module.VisionLanguage` checkpoint's model in this process.

    The model is rebuilt from the saved hyperparameters (text config, arch, encoder, connector),
    initialized once (RoPE tables, a pretrained encoder's folder must still exist) and then filled
    with the saved weights, the frozen encoder's included.

    Raises:
        CheckpointError / RuntimeError: as :func:`load_checkpoint_model`.
        ValueError: not a VLM checkpoint.
    """
    from kempnerforge.config.vision import ConnectorConfig, VisionEncoderConfig
    from kempnerforge.config.vlm import VLMConfig
    from kempnerforge.model.vlm.model import VisionLanguageModel

    resolved, meta = resolve_and_verify(path)
    hp = meta.get("hyper_parameters") or {}
    if not isinstance(hp.get("vlm"), dict):
        raise ValueError(f"{resolved}: not a VisionLanguage checkpoint (no hyper_parameters['vlm'])")
    config = model_config_from_meta(meta, resolved)
    model = VisionLanguageModel(
        config, VLMConfig(**hp["vlm"]), VisionEncoderConfig(**hp["encoder"]), ConnectorConfig(**hp["connector"])
    ).to(device)
    model.init_weights(seed=int(hp.get("init_seed", 0)))
    load_model_state(model, resolved, "backbone.output.weight" if config.tie_embeddings else None, meta)
    return LoadedCheckpoint(model.eval(), config, resolved, meta)
