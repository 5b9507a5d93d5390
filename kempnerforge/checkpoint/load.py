"""Load a kempnerforge DCP checkpoint into a plain, unsharded model on one device, without a process group.

Inference, export and evaluation tools run in one process: no ``init_process_group``, whatever world
size and mesh (FSDP2, TP, EP) the checkpoint was saved with. ``torch.distributed.checkpoint.load``
runs without any collective in its ``no_dist`` mode and reads each
requested tensor whole from whichever shards hold its pieces, as ``dcp_to_torch_save`` does, but
only the model's keys: optimizer moments are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from kempnerforge.checkpoint.dcp_io import META_FILE, DCPCheckpointIO
from kempnerforge.config.model import ModelConfig
from kempnerforge.model.rope import rope_tables
from kempnerforge.model.transformer import Transformer

#: Prefix of the model's keys in a checkpoint: Lightning's ``state_dict`` of ``CausalLM`` holds ``model.*``.
MODEL_PREFIX = "state_dict.model."


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
        """The local tokenizer directory the training data was prepared with, when the run recorded one."""
        data = self.meta.get("datamodule_hyper_parameters") or {}
        return data.get("tokenizer")


def model_config_from_meta(meta: dict[str, Any], path: Path) -> ModelConfig:
    """The :class:`ModelConfig` stored in a checkpoint's hyperparameters (``CausalLM(config=...)``).

    Raises:
        ValueError: the checkpoint has no ``hyper_parameters.config`` (not written by ``CausalLM``,
            e.g. a VLM module, which these tools do not load yet), or holds unknown config fields.
    """
    hparams = meta.get("hyper_parameters") or {}
    config = hparams.get("config")
    if not isinstance(config, dict):
        raise ValueError(
            f"{path}: no hyper_parameters['config'] in {META_FILE}; only checkpoints of "
            "kempnerforge.module.CausalLM (decoder LLM, dense or MoE) can be loaded here."
        )
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"{path}: checkpoint config has fields {unknown} that ModelConfig does not know")
    return ModelConfig(**config)


def build_model(config: ModelConfig, device: torch.device | str = "cpu") -> Transformer:
    """An uninitialized :class:`Transformer` on ``device`` (meta-built, then ``to_empty``) with its RoPE
    tables and weight tying in place: ready to receive a state dict, nothing drawn at random."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    model.tie_weights()
    cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta, "cpu")
    with torch.no_grad():
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    return model


def load_checkpoint_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> LoadedCheckpoint:
    """Restore the model of a kempnerforge checkpoint in this process, without a process group.

    Args:
        path: a checkpoint directory or the folder holding ``latest`` (as ``kforge fit --ckpt_path``).
        device: where the model lives.
        dtype: cast floating parameters to this dtype after loading (None: as saved, fp32 in training).

    Raises:
        CheckpointError: incomplete or missing checkpoint (:meth:`DCPCheckpointIO.resolve`).
        ValueError: no model config in the checkpoint (:func:`model_config_from_meta`).
        RuntimeError: DCP misses a model key or a shape differs.
    """
    resolved = DCPCheckpointIO().resolve(path)
    meta = torch.load(resolved / META_FILE, map_location="cpu", weights_only=True)
    config = model_config_from_meta(meta, resolved)
    model = build_model(config, device)
    # Nested like the saved dict, so DCP's flattened keys ("state_dict.model.<fqn>") line up.
    own = {k: v for k, v in model.state_dict().items() if not (config.tie_embeddings and k == "output.weight")}
    state = {"state_dict": {f"model.{k}": v for k, v in own.items()}}
    dcp.load(state, checkpoint_id=resolved, no_dist=True)  # no collectives, even if a group exists
    loaded = {key.removeprefix("model."): tensor for key, tensor in state["state_dict"].items()}
    if config.tie_embeddings:
        loaded["output.weight"] = loaded["tok_embeddings.weight"]
    model.load_state_dict(loaded, strict=True)
    model.tie_weights()
    if dtype is not None:
        model.to(dtype=dtype)
        model.rope_cos.data, model.rope_sin.data = model.rope_cos.float(), model.rope_sin.float()
    return LoadedCheckpoint(model.eval(), config, resolved, meta)
