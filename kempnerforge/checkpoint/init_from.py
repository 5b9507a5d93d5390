"""Fine-tuning from a Hugging Face folder: ``--model.init_from=<save_pretrained dir>``.

Three steps, at three times:

1. Configuration (``CausalLM.__init__``, before any process group): the model config is the folder's
   ``config.json`` through the family converters (:func:`~kempnerforge.checkpoint.convert.model_config_from_hf`);
   a ``--model.config.*`` value that changes the network is refused (:func:`merge_model_config`).
2. Preflight (``kforge`` before rendezvous): the folder holds safetensors weights and none the model would drop
   (DeepSeek-V3's multi-token-prediction layers; :func:`check_init_from`).
3. Weights (``Transformer.init_weights``, after TP / EP / FSDP2 sharding and ``to_empty``): each rank reads only the
   elements of each parameter it stores, through ``safetensors`` slices (:func:`~kempnerforge.checkpoint.hf_load.load_hf_weights_`); the optimizer and
   LR schedule start fresh. This follows litgpt's ``--initial_checkpoint_dir`` / torchtitan's HF-checkpoint load,
   with torchtitan's rule that weights are loaded into the already-sharded model.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import torch

from kempnerforge.checkpoint.hf_load import (  # load_hf_weights_ and read_hf_config re-exported: one import place
    FIELD,
    _check_all_read,
    _folder,
    _sources,
    hf_family_of,
    load_hf_weights_,  # noqa: F401 (re-exported)
    read_hf_config,
)
from kempnerforge.config.model import ModelConfig
from kempnerforge.errors import PathError, UserError

#: ``ModelConfig`` fields a run may set on top of a pretrained model: they shape the training objective or the
#: (unused) random init, not what the weights mean.
#: ``fuse_qkv`` / ``fuse_w13`` only lay the same weights out differently (the folder's separate projections are read
#: into the fused rows).
TRAINING_FIELDS = frozenset(
    {"init_std", "aux_loss_weight", "seq_aux_loss_weight", "z_loss_weight", "bias_update_rate", "fuse_qkv", "fuse_w13"}
)
#: Fields that only derive the feed-forward width when ``ffn_hidden_dim`` is unset (HF configs set it): compared
#: through the width they give.
_WIDTH_FIELDS = frozenset({"ffn_dim_multiplier", "multiple_of"})


def model_config_from_folder(path: str | Path) -> ModelConfig:
    """Our :class:`ModelConfig` for the HF folder ``path`` (through the family registry's ``from_hf_config``,
    as :func:`~kempnerforge.checkpoint.convert.model_config_from_hf`).

    Raises:
        PathError, UserError: see :func:`read_hf_config`; an architecture the converters do not support, or a
            feature they cannot represent (the converter's message, under ``model.init_from``); a LLaVA folder
            (``kforge convert hf-to-dcp`` imports it).
    """
    from kempnerforge.checkpoint.hf_families import family_for_hf_config

    hf_config = read_hf_config(path)
    if getattr(hf_config, "model_type", None) == "llava":  # a whole VLM, not a language model
        raise UserError(
            FIELD,
            f"{path} is a LLaVA folder (a whole vision-language model); init_from takes the language model's "
            "folder: import this one with kforge convert hf-to-dcp and train with --ckpt_path",
        )
    try:
        return family_for_hf_config(hf_config).module.from_hf_config(hf_config)
    except ValueError as err:
        arch = ", ".join(getattr(hf_config, "architectures", None) or []) or getattr(hf_config, "model_type", "?")
        raise UserError(FIELD, f"{path} holds {arch}, which kempnerforge cannot load: {err}") from err


def merge_model_config(from_hf: ModelConfig, given: ModelConfig, path: str | Path) -> ModelConfig:
    """The run's model config: ``from_hf`` plus the fields ``given`` sets (differs from ``ModelConfig()``) that do
    not change the network: :data:`TRAINING_FIELDS`, a shorter ``max_seq_len`` (the RoPE tables are recomputed;
    a longer one would extrapolate past what the checkpoint was trained on), and any field equal to the folder's.

    Raises:
        UserError: a field of ``given`` that conflicts with the folder's config, as ``model.config.<field>``
            (the first one, with both values).
    """
    default, updates = ModelConfig(), {}
    for f in fields(ModelConfig):
        name, value, hf_value = f.name, getattr(given, f.name), getattr(from_hf, f.name)
        if value == getattr(default, name) or value == hf_value:
            continue
        if name in TRAINING_FIELDS or (name == "max_seq_len" and value <= hf_value):
            updates[name] = value
        elif name in _WIDTH_FIELDS and from_hf.ffn_hidden_dim is not None:
            continue  # the HF width is explicit; these only derive one without it
        else:
            allowed = f"<= {hf_value}" if name == "max_seq_len" else f"{hf_value!r} (or unset)"
            raise UserError(
                f"model.config.{name}",
                f"{value!r} conflicts with {path}/config.json (model.init_from), which gives {hf_value!r}; allowed: "
                f"{allowed}: the architecture comes from the checkpoint",
            )
    return replace(from_hf, **updates) if updates else from_hf


def resolve_model_config(path: str | Path, given: ModelConfig) -> ModelConfig:
    """:func:`model_config_from_folder` merged with the user's ``given`` config (:func:`merge_model_config`).

    Raises:
        UserError: see both and :func:`check_folder_weights`; also a family whose converter has no per-key mapping
            (``hf_source``) to load from.
    """
    cfg = merge_model_config(model_config_from_folder(path), given, path)
    check_folder_weights(path, read_hf_config(path))
    try:
        family = hf_family_of(cfg)
    except ValueError as err:
        raise UserError(FIELD, f"{path}: {err}") from err
    if not hasattr(family, "hf_source"):
        raise UserError(
            FIELD,
            f"{path} is a {family.__name__.rsplit('.', 1)[-1]} checkpoint, whose converter has no per-key mapping "
            "(hf_source) for a sharded load yet; import it with kforge convert hf-to-dcp and train with --ckpt_path",
        )
    return cfg


def check_init_from(path: str | Path) -> None:
    """The folder ``path`` can be loaded: ``config.json``, safetensors weights, and the family's own folder check
    (:func:`check_folder_weights`; only safetensors headers are read).

    Raises:
        PathError: not a directory, no ``config.json``, or no ``*.safetensors`` files (a ``pytorch_model.bin``
            folder: re-save it with ``save_pretrained``, whose default is safetensors).
        UserError: see :func:`read_hf_config` and :func:`check_folder_weights`.
    """
    folder = _folder(path)
    if not any(folder.glob("*.safetensors")):
        held = sorted(p.name for p in folder.iterdir())[:8]
        raise PathError(
            FIELD,
            f"{path} has no .safetensors weights (it holds {held}); re-save it with transformers' save_pretrained "
            "(safetensors is its default format)",
        )
    check_folder_weights(path, read_hf_config(path))


def check_folder_weights(path: str | Path, hf_config) -> None:
    """The family's own check of the folder's weights, when it has one (``check_hf_dir``: DeepSeek-V3 refuses
    multi-token-prediction layers, which the model would drop). Reads the safetensors index or file headers only.

    Raises:
        UserError: the family's refusal, under ``model.init_from``, on one line.
    """
    from kempnerforge.checkpoint.hf_families import family_for_hf_config

    try:
        family = family_for_hf_config(hf_config).module
    except ValueError:
        return  # an unsupported architecture is refused, with its message, by model_config_from_folder
    if hasattr(family, "check_hf_dir"):
        try:
            family.check_hf_dir(path, hf_config)
        except ValueError as err:
            raise UserError(FIELD, str(err).replace("\n", " ")) from err


#: Files any ``transformers`` tokenizer folder holds at least one of (fast, sentencepiece, BPE vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_tokenizer_files(path: str | Path) -> None:
    """The folder ``path``, used as ``data.tokenizer`` (its default with ``model.init_from``), holds tokenizer files.

    Raises:
        PathError: none of :data:`TOKENIZER_FILES` is there (field ``data.tokenizer``).
    """
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise PathError(
            "data.tokenizer",
            f"{path} (model.init_from) holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy the checkpoint's "
            "tokenizer there or set data.tokenizer to its folder",
        )


def check_hf_weights(path: str | Path, cfg: ModelConfig) -> None:
    """The folder's safetensors files are whole and hold exactly the tensors, of the shapes, a model of ``cfg`` reads
    (the checks :func:`load_hf_weights_` makes, from the file headers only: no tensor data is read, and the model
    is built on the meta device). Preflight runs it on global rank 0 before any process group exists, so a
    truncated or missing shard, a missing or extra tensor, or a ``config.json`` that does not match its weights is
    one line instead of a failure on every rank after sharding.

    Raises:
        PathError: a shard named by the index is missing, or a file's header does not parse or its data is shorter
            than the header says (field ``model.init_from``, naming the file and the reason).
        UserError: a parameter without a folder tensor, a tensor of another shape, or a tensor nothing reads
            (field ``model.init_from``).
    """
    from kempnerforge.model.safetensors_shards import SafetensorsFolder
    from kempnerforge.model.transformer import Transformer

    try:
        folder = SafetensorsFolder(path)
        folder.open_all()
    except (OSError, ValueError, KeyError) as err:
        what = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PathError(
            FIELD,
            f"{path}: the safetensors weights cannot be opened ({what}); a shard is missing, truncated or corrupt: "
            "copy or save the folder again",
        ) from err
    with torch.device("meta"):
        model = Transformer(cfg)
    used: set[str] = set()
    try:
        with folder:
            disk = folder.keys()
            for param, source in _sources(model, cfg, disk, path):
                folder.check_source(tuple(param.shape), source)
                used.update(source.keys)
            _check_all_read(model, path, cfg, disk, used)
    except (KeyError, ValueError) as err:
        msg = err.args[0] if err.args else str(err)
        raise UserError(
            FIELD,
            f"{msg.removeprefix(f'{FIELD}=')}; its weights do not match its config.json (allowed: the tensors "
            "save_pretrained writes for that config)",
        ) from err
