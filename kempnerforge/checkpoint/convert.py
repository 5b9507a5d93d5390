"""Conversion between kempnerforge DCP checkpoints and Hugging Face ``transformers`` directories.

``dcp_to_hf`` writes what ``AutoModelForCausalLM.from_pretrained`` loads: ``config.json``,
``model.safetensors`` (or shards plus ``model.safetensors.index.json`` above ``max_shard_size``,
through ``PreTrainedModel.save_pretrained``) and the tokenizer files. ``hf_to_dcp`` reads such a
directory (through ``from_pretrained``, which also understands older key layouts) into a
weights-only DCP checkpoint that ``kforge fit --ckpt_path`` starts from with a fresh optimizer,
schedule and data position.

Families (dispatched by :mod:`~kempnerforge.checkpoint.hf_families`): dense ``LlamaForCausalLM`` with
``llama3`` / ``yarn`` RoPE scaling (:mod:`~kempnerforge.checkpoint.hf_llama`), ``Qwen2ForCausalLM`` (q/k/v biases,
:mod:`~kempnerforge.checkpoint.hf_qwen2`), ``Qwen3ForCausalLM`` (QK-norm, explicit head_dim,
:mod:`~kempnerforge.checkpoint.hf_qwen3`), ``Qwen3MoeForCausalLM`` (:mod:`~kempnerforge.checkpoint.hf_qwen3_moe`),
softmax-routed ``MixtralForCausalLM`` (:mod:`~kempnerforge.checkpoint.hf_mixtral`) and softmax-routed MoE with
gated shared experts ``Qwen2MoeForCausalLM`` (:mod:`~kempnerforge.checkpoint.hf_qwen2_moe`), and multi-head
latent attention with group-limited sigmoid routing ``DeepseekV3ForCausalLM``
(:mod:`~kempnerforge.checkpoint.hf_deepseek_v3`). Anything without
a faithful HF equivalent (sliding windows, other RoPE types, sigmoid routing, route scaling, capacity dropping,
ungated shared experts, Mixtral with MoE on some layers only) is refused with the field that prevents it: a
weight is never dropped silently.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from kempnerforge.checkpoint.dcp_io import WEIGHTS_ONLY_KEY, DCPCheckpointIO
from kempnerforge.checkpoint.hf_families import family_for_config, family_for_hf_config
from kempnerforge.checkpoint.hf_quiet import quiet_transformers
from kempnerforge.checkpoint.load import TOKENIZER_KEY, build_model, load_checkpoint_model
from kempnerforge.config.model import ModelConfig

#: dtype names accepted by ``--dtype``.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Checkpoint metadata key of an imported model's special token ids (``bos/eos/pad_token_id``), restored on export.
HF_TOKEN_IDS_KEY = "hf_token_ids"
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
#: Files of a model directory that are not the tokenizer's (never copied as tokenizer files; a README is the source
#: folder's model card, not the exported model's).
_NOT_TOKENIZER = ("config.json", "generation_config.json", "model.safetensors.index.json", "README.md")


def hf_family(cfg: ModelConfig) -> ModuleType:
    """The mapping module ``cfg`` exports with (:func:`~kempnerforge.checkpoint.hf_families.family_for_config`).

    Raises:
        ValueError: the config has no faithful HF equivalent (names the field and allowed values).
    """
    return family_for_config(cfg).module


def dtype_from_name(name: str) -> torch.dtype:
    """``torch.dtype`` for ``float32`` / ``bfloat16`` / ``float16``.

    Raises:
        ValueError: another name.
    """
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; allowed: {sorted(DTYPES)}")
    return DTYPES[name]


def dcp_to_hf(
    ckpt: str | Path,
    output_dir: str | Path,
    dtype: str = "float32",
    max_shard_size: str | int = "5GB",
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a kempnerforge checkpoint as a ``transformers`` directory (one process, no process group): a text
    model as its family's ``*ForCausalLM``, a joint_decoder VLM as ``LlavaForConditionalGeneration`` with its
    processor (:mod:`~kempnerforge.checkpoint.hf_llava`).

    The directory is written beside ``output_dir`` first and swapped in when complete, so an existing folder is
    either left as it was or replaced whole (never a mix of old and new tokenizer / chat-template files).

    Args:
        ckpt: checkpoint directory or the folder holding ``latest``.
        output_dir: directory to write; a non-empty one is refused unless ``overwrite``.
        dtype: weight dtype in the safetensors files: float32, bfloat16 or float16.
        max_shard_size: largest safetensors file (``save_pretrained`` syntax: "5GB" or bytes); larger
            models are split into ``model-0000i-of-0000n.safetensors`` plus an index.
        tokenizer: local tokenizer directory whose files are copied; None uses the one the training
            data was prepared with (recorded in the checkpoint), if any.

    Returns:
        ``output_dir`` as a Path.

    Raises:
        ValueError: a model without HF equivalent (:func:`hf_family`), an unknown dtype.
        FileNotFoundError: ``tokenizer`` is not a directory.
        FileExistsError: ``output_dir`` is a file, or a non-empty folder and not ``overwrite``.
    """
    out = Path(output_dir)
    refuse_export_target(out, overwrite)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise FileNotFoundError(f"tokenizer={str(tokenizer)!r} is not a directory")
    torch_dtype = dtype_from_name(dtype)
    from kempnerforge.checkpoint.load import is_vlm_checkpoint

    if is_vlm_checkpoint(ckpt):
        hf_model, write_extras = _llava_model(ckpt, torch_dtype, tokenizer)
    else:
        hf_model, write_extras = _text_model(ckpt, torch_dtype, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        hf_model.save_pretrained(staging, max_shard_size=max_shard_size)
        write_extras(staging)
        _swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _cast(hf_sd: dict[str, torch.Tensor], dtype: torch.dtype, keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """``hf_sd`` in ``dtype``, contiguous; keys ending in ``keep`` (a family's ``KEEP_FP32``: routers) in fp32."""
    return {k: v.detach().to(torch.float32 if k.endswith(keep) else dtype).contiguous() for k, v in hf_sd.items()}


def _text_model(ckpt: str | Path, dtype: torch.dtype, tokenizer: str | Path | None):
    """The ``*ForCausalLM`` of a text checkpoint (built on meta, holding its weights) and what writes its tokenizer."""
    loaded = load_checkpoint_model(ckpt)
    family = hf_family(loaded.config)
    hf_config = family.to_hf_config(loaded.config)
    hf_config.dtype = dtype
    tok = tokenizer if tokenizer is not None else loaded.tokenizer
    ids = tokenizer_token_ids(tok) if tok is not None else {}
    ids.update(loaded.meta.get(HF_TOKEN_IDS_KEY) or {})  # an imported model's bos/eos/pad ids win
    for key in _TOKEN_IDS:  # never the family config's defaults (Llama's 1 / 2 are '"' and '#' in GPT-2's vocabulary)
        setattr(hf_config, key, ids.get(key))
    hf_sd = _cast(
        family.to_hf_state_dict(loaded.model.state_dict(), loaded.config), dtype, getattr(family, "KEEP_FP32", ())
    )
    hf_model = _hf_model_with(hf_config, hf_sd, loaded.config.tie_embeddings)

    def write_extras(folder: Path) -> None:
        if tok is not None:
            copy_tokenizer_files(tok, folder)

    return hf_model, write_extras


def _llava_model(ckpt: str | Path, dtype: torch.dtype, tokenizer: str | Path | None):
    """The ``LlavaForConditionalGeneration`` of a joint_decoder VLM checkpoint (:mod:`~kempnerforge.checkpoint.hf_llava`)
    and what writes its processor (image processor, tokenizer with ``<image>``, chat template).

    Raises:
        ValueError: the VLM has no LLaVA equivalent (:func:`~kempnerforge.checkpoint.hf_llava.check_llava_exportable`),
            or no tokenizer is recorded or given.
    """
    from transformers import LlavaForConditionalGeneration

    from kempnerforge.checkpoint.hf_llava import (
        check_llava_exportable,
        llava_config,
        llava_processor,
        llava_state_dict,
        llava_tokenizer,
    )
    from kempnerforge.checkpoint.load import load_vlm_checkpoint
    from kempnerforge.config.vision import ConnectorConfig, VisionEncoderConfig
    from kempnerforge.config.vlm import VLMConfig

    loaded = load_vlm_checkpoint(ckpt)
    hp = loaded.meta["hyper_parameters"]
    encoder = VisionEncoderConfig(**hp["encoder"])
    check_llava_exportable(VLMConfig(**hp["vlm"]), encoder, ConnectorConfig(**hp["connector"]))
    tok_dir = tokenizer if tokenizer is not None else loaded.tokenizer
    if tok_dir is None:
        raise ValueError("a vision-language export needs its tokenizer (LLaVA's adds <image>); give --tokenizer")
    tok, image_id = llava_tokenizer(tok_dir)
    family = hf_family(loaded.config)
    rows = max(loaded.config.vocab_size, image_id + 1)
    text_config = family.to_hf_config(loaded.config)
    text_config.vocab_size = rows
    sd = loaded.model.state_dict()
    backbone = {k.removeprefix("backbone."): v for k, v in sd.items() if k.startswith("backbone.")}
    hf_sd = _cast(llava_state_dict(family.to_hf_state_dict(backbone, loaded.config), sd, rows), dtype)
    config = llava_config(text_config, encoder, loaded.model.n_visual, image_id, loaded.config.tie_embeddings)
    config.dtype = dtype
    model = _hf_model_with(config, hf_sd, loaded.config.tie_embeddings, LlavaForConditionalGeneration)
    processor = llava_processor(tok, encoder, config)
    return model, processor.save_pretrained


def refuse_export_target(out: Path, overwrite: bool) -> None:
    """Refuse an export target that is a file, or a non-empty folder without ``overwrite``.

    Raises:
        FileExistsError: either case (the message names the folder and the ``--overwrite`` flag).
    """
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; give a folder (new or empty)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out} is not empty; give a new or empty folder, or --overwrite to replace the whole folder"
        )


def _swap_in(staging: Path, out: Path) -> None:
    """Put the complete ``staging`` folder at ``out``; an existing ``out`` is removed only after the rename."""
    old = out.with_name(f".{out.name}.old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    mask = _umask()
    for f in staging.rglob("*"):  # safetensors writes its files 0600: the group could not read the weights
        f.chmod((0o777 if f.is_dir() else 0o666) & ~mask)
    staging.chmod(0o777 & ~mask)  # mkdtemp makes it 0700
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    """The process's umask (the permissions every other file the user writes gets), read without changing it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc: the only portable read sets it, so it is set straight back
    os.umask(mask)
    return mask


def _hf_model_with(hf_config, hf_sd: dict[str, torch.Tensor], tied: bool, model_cls=None) -> nn.Module:
    """The HF model for ``hf_config`` (``model_cls``, default ``AutoModelForCausalLM``) holding exactly ``hf_sd``
    (built on meta: no random init, no copy)."""
    from transformers import AutoModelForCausalLM  # local import: transformers is slow to import

    with torch.device("meta"):
        model = model_cls(hf_config) if model_cls is not None else AutoModelForCausalLM.from_config(hf_config)
    result = model.load_state_dict(hf_sd, strict=False, assign=True)
    expected_missing = ["lm_head.weight"] if tied else []
    if result.unexpected_keys or sorted(result.missing_keys) != expected_missing:
        raise RuntimeError(
            f"HF {type(model).__name__} state dict mismatch: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}"
        )
    if tied:
        model.tie_weights()
    return model


def tokenizer_token_ids(tokenizer_dir: str | Path) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of a local tokenizer folder (those it defines), as
    ``transformers.AutoTokenizer`` reads them: what an exported ``config.json`` and ``generation_config.json`` carry
    so that ``generate`` stops at the tokenizer's end of text.

    Raises:
        OSError: the folder holds no tokenizer ``transformers`` can load.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return {key: int(value) for key, value in ids.items() if value is not None}


def copy_tokenizer_files(tokenizer_dir: str | Path, output_dir: Path) -> list[str]:
    """Copy a local tokenizer directory's files (not model config or weights) into ``output_dir``.

    Returns:
        The copied file names.

    Raises:
        FileNotFoundError: ``tokenizer_dir`` is not a directory.
    """
    src = Path(tokenizer_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"tokenizer={str(src)!r} is not a directory")
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in _NOT_TOKENIZER and f.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy2(f, output_dir / f.name)
            copied.append(f.name)
    return copied


def model_config_from_hf(hf_config) -> ModelConfig:
    """Our :class:`ModelConfig` for a ``transformers`` config of a registered family (Llama, Qwen 2 / 3, Qwen3-MoE,
    Mixtral, Qwen2-MoE; :func:`~kempnerforge.checkpoint.hf_families.family_for_hf_config`).

    Raises:
        ValueError: another ``model_type``, or features our model lacks (each family's ``from_hf_config`` names the
            HF field: sliding windows, other RoPE types, biases on o_proj, ``mlp_only_layers``, ...).
    """
    return family_for_hf_config(hf_config).module.from_hf_config(hf_config)


def hf_to_dcp(hf_dir: str | Path, output_dir: str | Path, name: str = "step=0.ckpt") -> Path:
    """Import a local ``transformers`` directory as a weights-only kempnerforge DCP checkpoint (a LLaVA folder as a
    joint_decoder VLM, its vision tower also saved as ``output_dir/vision_tower``).

    Weights are read in fp32 (exact from fp32, bf16 or fp16 files). The result is
    ``output_dir/<name>`` with ``COMPLETE`` and ``latest`` (the layout of
    :mod:`~kempnerforge.checkpoint.dcp_io`) and ``output_dir/model.yaml``, the ``--model.config`` to
    train it with: ``kforge fit --config <recipe> --config <output_dir>/model.yaml --ckpt_path <output_dir>``.
    Its ``meta.pt`` carries :data:`WEIGHTS_ONLY_KEY`, so the run starts a fresh optimizer and schedule.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: not a folder with a readable ``config.json``; an unsupported model (:func:`model_config_from_hf`);
            weights transformers cannot load (a missing or truncated shard, wrong shapes), or that miss a tensor of
            the config or hold one it does not read (``from_pretrained`` would invent or drop it).
        KeyError: HF weights with no counterpart in our model, or missing weights.
        FileExistsError: ``output_dir`` already holds checkpoints (a ``latest`` pointer or ``*.ckpt``).
    """
    from transformers import AutoModelForCausalLM  # local import: transformers is slow to import

    _refuse_checkpoint_folder(output_dir)
    hf_config = _read_hf_config(hf_dir)
    if hf_config.model_type == "llava":
        return _llava_to_dcp(hf_dir, hf_config, output_dir, name)
    family = family_for_hf_config(hf_config).module
    cfg = family.from_hf_config(hf_config)
    _refuse_larger_tokenizer(hf_dir, cfg.vocab_size)
    # The optional family hooks init_from uses too: weights from_pretrained would skip (DeepSeek-V3's MTP layers),
    # and options the folder's config sets for the mapping (DeepSeek-V3's RoPE row layout).
    if hasattr(family, "check_hf_dir"):
        family.check_hf_dir(hf_dir, hf_config)
    extra = family.hf_source_options(hf_config) if hasattr(family, "hf_source_options") else {}
    from safetensors import SafetensorError

    try:
        with quiet_transformers():
            hf_model, info = AutoModelForCausalLM.from_pretrained(
                hf_dir, local_files_only=True, dtype=torch.float32, output_loading_info=True
            )
    except (
        OSError,
        RuntimeError,
        ValueError,
        SafetensorError,
    ) as err:  # a missing / truncated shard, shapes that do not match
        why = _first_line(err)
        if "ignore_mismatched_sizes" in why:  # transformers points at its load report, which quiet_transformers hid
            why = "a tensor's shape differs from what its config.json gives"
        raise ValueError(f"{hf_dir}: transformers cannot load its weights: {why}") from err
    # from_pretrained fills a missing tensor with a fresh random init and drops an unexpected one: refuse both.
    bad = {k: sorted(info.get(k) or ())[:4] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(bad.values()):
        found = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in bad.items() if v)
        raise ValueError(
            f"{hf_dir}: its weights do not match its config.json ({found}); nothing is dropped or invented"
        )
    sd = family.from_hf_state_dict(hf_model.state_dict(), cfg, **extra)
    model = build_model(cfg)
    model.load_state_dict(sd, strict=True)
    model.tie_weights()
    token_ids = {k: getattr(hf_config, k, None) for k in _TOKEN_IDS}
    tokenizer = str(Path(hf_dir).resolve()) if _has_tokenizer_files(hf_dir) else None
    return write_weights_checkpoint(
        model, cfg, output_dir, name, source=str(hf_dir), token_ids=token_ids, tokenizer=tokenizer
    )


def _llava_to_dcp(hf_dir: str | Path, hf_config, output_dir: str | Path, name: str) -> Path:
    """:func:`hf_to_dcp` of a ``LlavaForConditionalGeneration`` folder: a joint_decoder VLM checkpoint
    (:mod:`~kempnerforge.checkpoint.hf_llava`); the vision tower is also saved, with its image processor, as
    ``output_dir/vision_tower`` (the encoder's ``pretrained_path``: its exact architecture)."""
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    from kempnerforge.checkpoint.hf_llava import split_llava_state_dict, vlm_configs_from_llava
    from kempnerforge.model.vlm.model import VisionLanguageModel

    family = family_for_hf_config(hf_config.text_config).module
    cfg = family.from_hf_config(hf_config.text_config)
    tower_dir = Path(output_dir) / "vision_tower"
    vlm, encoder, connector = vlm_configs_from_llava(hf_config, tower_dir)
    with quiet_transformers():
        hf_model, info = LlavaForConditionalGeneration.from_pretrained(
            hf_dir, local_files_only=True, dtype=torch.float32, output_loading_info=True
        )
    bad = {k: sorted(info.get(k) or ())[:4] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(bad.values()):
        raise ValueError(f"{hf_dir}: its weights do not match its config.json ({bad}); nothing is dropped or invented")
    text, tower, projector = split_llava_state_dict(hf_model.state_dict())
    hf_model.model.vision_tower.save_pretrained(tower_dir)
    if (Path(hf_dir) / "preprocessor_config.json").is_file() or (Path(hf_dir) / "processor_config.json").is_file():
        AutoImageProcessor.from_pretrained(hf_dir, local_files_only=True).save_pretrained(tower_dir)
    model = VisionLanguageModel(cfg, vlm, encoder, connector)  # eager: RoPE tables built; every weight loaded below
    model.backbone.load_state_dict(family.from_hf_state_dict(text, cfg), strict=True)
    model.encoder.model.load_state_dict(tower, strict=True)
    model.connector.load_state_dict(projector, strict=True)
    model.tie_weights()
    hparams = {"vlm": asdict(vlm), "encoder": asdict(encoder), "connector": asdict(connector)}
    tokenizer = str(Path(hf_dir).resolve()) if _has_tokenizer_files(hf_dir) else None
    return write_weights_checkpoint(
        model, cfg, output_dir, name, source=str(hf_dir), tokenizer=tokenizer, hparams=hparams
    )


def _refuse_larger_tokenizer(hf_dir: str | Path, vocab_size: int) -> None:
    """Refuse a folder whose tokenizer gives ids the model has no embedding row for (generate would fail later
    with an ``IndexError``).

    Raises:
        ValueError: the tokenizer (base vocabulary plus added tokens) holds more tokens than ``vocab_size``.
    """
    if not _has_tokenizer_files(hf_dir):
        return
    from transformers import AutoTokenizer  # local import: transformers is slow to import

    try:
        with quiet_transformers():
            size = len(AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True))
    except (OSError, ValueError, KeyError, TypeError):  # unreadable tokenizer files: the weights check decides
        return
    if size > vocab_size:
        raise ValueError(
            f"{hf_dir}: its tokenizer has {size} tokens but the model's vocab_size is {vocab_size} (ids "
            f"{vocab_size}..{size - 1} have no embedding row); use the tokenizer the model was trained with"
        )


def _has_tokenizer_files(folder: str | Path) -> bool:
    from kempnerforge.checkpoint.init_from import TOKENIZER_FILES

    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


def _refuse_checkpoint_folder(output_dir: str | Path) -> None:
    """An import never lands in a folder that already holds checkpoints: it would repoint ``latest`` to step 0, and
    a run auto-resuming from that folder would restart from the imported weights.

    Raises:
        FileExistsError: ``output_dir`` holds a ``latest`` pointer or a ``*.ckpt`` checkpoint (names it).
    """
    out = Path(output_dir)
    held = (
        sorted(p.name for p in out.iterdir() if p.name == "latest" or p.name.endswith(".ckpt")) if out.is_dir() else []
    )
    if held:
        raise FileExistsError(
            f"{output_dir} already holds checkpoints ({', '.join(held[:3])}); importing there would repoint latest to "
            "the imported weights: choose an empty or new folder"
        )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _read_hf_config(hf_dir: str | Path):
    """The ``transformers`` config of the local folder ``hf_dir``.

    Raises:
        ValueError: not a directory, no ``config.json``, or one transformers cannot read (an unknown ``model_type``).
    """
    from transformers import AutoConfig

    folder = Path(hf_dir).expanduser()
    if not (folder / "config.json").is_file():
        what = "has no config.json" if folder.is_dir() else "is not a directory"
        raise ValueError(f"{hf_dir} {what} (a local transformers save_pretrained folder); nothing is downloaded")
    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"{hf_dir}/config.json cannot be read by transformers: {_first_line(err)}") from err


def write_weights_checkpoint(
    model: nn.Module,
    cfg: ModelConfig,
    output_dir: str | Path,
    name: str,
    source: str,
    token_ids: dict | None = None,
    tokenizer: str | None = None,
    hparams: dict | None = None,
) -> Path:
    """Write ``model``'s weights as a kempnerforge checkpoint (keys as ``CausalLM`` saves them) plus ``model.yaml``;
    ``token_ids`` (an HF config's ``bos/eos/pad_token_id``) are kept for :func:`dcp_to_hf`, and ``tokenizer`` (a
    local tokenizer folder) is recorded for ``kforge generate`` / ``eval`` / ``dcp-to-hf``; ``hparams`` adds
    hyperparameters (a VLM's ``vlm`` / ``encoder`` / ``connector``, as ``VisionLanguage`` saves them)."""
    import lightning

    holder = nn.Module()  # CausalLM keeps its decoder under ``model``: same FQNs as a training save
    holder.model = model
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = {
        "state_dict": get_model_state_dict(holder),
        "hyper_parameters": {"config": asdict(cfg), **(hparams or {})},
        "lr_schedulers": [],  # fresh schedule: Lightning restores none
        "pytorch-lightning_version": lightning.__version__,  # Lightning's resume reads it (no migration)
        WEIGHTS_ONLY_KEY: True,
        "source": source,
    }
    if token_ids is not None:
        checkpoint[HF_TOKEN_IDS_KEY] = token_ids
    if tokenizer is not None:
        checkpoint[TOKENIZER_KEY] = tokenizer
    DCPCheckpointIO().save_checkpoint(checkpoint, out / name)
    (out / "model.yaml").write_text(_model_yaml(cfg, hparams))
    return out / name


def _model_yaml(cfg: ModelConfig, hparams: dict | None = None) -> str:
    """The ``--config`` to train the import with: ``model.config`` (a text model), or a VLM's ``model.init_args``."""
    import yaml  # PyYAML ships with jsonargparse[signatures] / lightning

    if hparams:
        model = {"class_path": "kempnerforge.module.VisionLanguage", "init_args": {"config": asdict(cfg), **hparams}}
        return yaml.safe_dump({"model": model}, sort_keys=False)
    return yaml.safe_dump({"model": {"config": asdict(cfg)}}, sort_keys=False)
