"""Reading a Hugging Face ``save_pretrained`` folder into the sharded model (``model.init_from``, step 3 of
:mod:`~kempnerforge.checkpoint.init_from`): each rank reads, parameter by parameter, only the elements it stores.

Kept apart from :mod:`~kempnerforge.checkpoint.init_from` (configuration and preflight, which build the model on
the meta device) because ``Transformer.init_weights`` calls :func:`load_hf_weights_`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from kempnerforge.checkpoint.hf_source import HFSource
from kempnerforge.config.model import ModelConfig
from kempnerforge.errors import PathError, UserError

FIELD = "model.init_from"


def _folder(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise PathError(
            FIELD, f"{path} is not a directory (a transformers save_pretrained folder); nothing is downloaded"
        )
    if not (folder / "config.json").is_file():
        raise PathError(FIELD, f"{path} has no config.json (a transformers save_pretrained folder)")
    return folder


def read_hf_config(path: str | Path):
    """The ``transformers`` config of the folder ``path`` (its ``config.json``, read locally).

    Raises:
        PathError: ``path`` is not a directory or has no ``config.json`` (field ``model.init_from``).
        UserError: ``transformers`` cannot read it (an unknown ``model_type``, broken JSON).
    """
    folder = _folder(path)
    from transformers import AutoConfig  # local import: transformers is slow to import

    from kempnerforge.checkpoint.hf_quiet import quiet_transformers

    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(FIELD, f"{path}/config.json cannot be read by transformers: {first}") from err


def hf_family_of(cfg: ModelConfig):
    """The converter module whose ``hf_source`` maps ``cfg``'s parameters (the same family as ``kforge convert``)."""
    from kempnerforge.checkpoint.hf_families import family_for_config

    return family_for_config(cfg).module


def _sources(
    model: nn.Module,
    cfg: ModelConfig,
    disk: set[str],
    path: str | Path,
    text_key: Callable[[str], str | None] | None = None,
    copies: Callable[[str], int] | None = None,
):
    """``(tensor, HFSource)`` for every parameter of ``model`` and every buffer the family loads (``HF_BUFFERS``,
    e.g. DeepSeek-V3's router correction bias), through the family's ``hf_source`` with the options the folder's
    config sets (``hf_source_options``, e.g. DeepSeek-V3's ``rope_interleave``).

    ``text_key`` maps a parameter's canonical FQN to the dense decoder's (a VLM backbone's
    :meth:`~kempnerforge.model.vlm.base.VLMBackbone.text_key`; None: skip the parameter) and ``copies`` to the number
    of copies stacked along a new dim 0 (:func:`repeated_source`); both default to the identity."""
    from kempnerforge.model.init import canonical_fqn

    family = hf_family_of(cfg)
    options = family.hf_source_options(read_hf_config(path)) if hasattr(family, "hf_source_options") else {}
    loaded = getattr(family, "HF_BUFFERS", ())
    buffers = [(n, b) for n, b in model.named_buffers() if loaded and canonical_fqn(n).endswith(loaded)]
    for name, tensor in [*model.named_parameters(), *buffers]:
        own = canonical_fqn(name)
        fqn = own if text_key is None else text_key(own)
        if fqn is None:
            continue
        if fqn == "output.weight" and cfg.tie_embeddings:  # a pipeline's last stage: its own copy of the tie
            fqn = "tok_embeddings.weight"
        source = family.hf_source(fqn, cfg, disk, **options)
        n = 0 if copies is None else copies(own)
        yield tensor, repeated_source(source, n, own) if n else source


def repeated_source(source: HFSource, n: int, fqn: str) -> HFSource:
    """``n`` copies of the one-key ``source`` stacked along a new dim 0 (a MoMa expert group upcycled from the dense
    FFN, Komatsuzaki et al., arXiv:2212.05055): each rank reads the block once per expert it stores.

    Raises:
        ValueError: ``source`` is itself a stack, a concatenation or a row permutation (names ``fqn``).
    """
    if source.stacked or source.concat or source.rows:
        raise ValueError(f"{FIELD}: {fqn} stacks copies of a tensor that is not one HF block ({source})")
    return HFSource(source.keys * n, offset=source.offset, stacked=True)


def _check_all_read(model: nn.Module, path: str | Path, cfg: ModelConfig, disk: set[str], used: set[str]) -> None:
    """With the whole model (no pipeline stage), every folder tensor was read by some parameter."""
    from kempnerforge.checkpoint.hf_llama import _HF_IGNORED

    whole = getattr(model, "tok_embeddings", None) is not None and len(getattr(model, "layers", ())) == cfg.n_layers
    unused = sorted(
        k for k in disk - used if not _HF_IGNORED.match(k) and not (k == "lm_head.weight" and cfg.tie_embeddings)
    )
    if whole and getattr(model, "output", None) is not None and unused:
        raise ValueError(f"{FIELD}={path}: tensors with no kempnerforge parameter: {unused[:8]}")


@torch.no_grad()
def load_hf_weights_(
    model: nn.Module,
    path: str | Path,
    cfg: ModelConfig,
    *,
    text_key: Callable[[str], str | None] | None = None,
    copies: Callable[[str], int] | None = None,
) -> set[int]:
    """Fill every parameter of ``model`` (plain tensors or DTensors of any FSDP2 / TP / EP layout, or a pipeline
    stage's part) from the HF folder ``path``, each rank reading only the elements it stores.

    Per parameter, the family's ``hf_source`` (one source of truth with the state-dict converters) names the HF
    tensor(s): a rename or block is one ``safetensors`` slice per run of this rank's indices; per-expert keys are
    read only for the experts this rank keeps. A tied head reads the embedding. Values are cast to each
    parameter's dtype (bf16 files into fp32 master weights are exact). Buffers (RoPE tables, router
    ``expert_bias``) are left to the caller (:func:`~kempnerforge.model.decoder_init.init_decoder_`). Preflight
    has already checked the same on rank 0 from the file headers (:func:`check_hf_weights`).

    Args:
        model: the materialized decoder (not on meta).
        path: the ``save_pretrained`` folder ``cfg`` was read from.
        cfg: its model config.
        text_key, copies: for a VLM backbone, its parameters' dense FQNs and stacked copies (see :func:`_sources`).

    Returns:
        The ``id`` of every parameter and buffer filled (every parameter unless ``text_key`` skips some).

    Raises:
        FileNotFoundError: no safetensors files.
        KeyError: a parameter the folder has no tensor for (names both).
        ValueError: a folder tensor with another shape; with the whole model (no pipeline stage), folder tensors
            nothing reads (e.g. biases our model lacks): a weight is never dropped silently.
    """
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    from kempnerforge.model.safetensors_shards import SafetensorsFolder

    start = time.perf_counter()
    done: set[int] = set()
    used: set[str] = set()
    with SafetensorsFolder(path) as folder:
        disk = folder.keys()
        for param, source in _sources(model, cfg, disk, path, text_key, copies):
            folder.read_source_(param, source)
            used.update(source.keys)
            done.add(id(param))
    _check_all_read(model, path, cfg, disk, used)
    nbytes = sum(getattr(p, "_local_tensor", p).nbytes for p in model.parameters() if id(p) in done)
    rank_zero_info(
        f"init_from: loaded {len(used)} tensors from {path} into {len(done)} parameters "
        f"({nbytes / 2**20:.1f} MiB on this rank) in {time.perf_counter() - start:.1f} s"
    )
    return done
