"""``kforge generate``: sample from a checkpoint on one device, without a process group.

    kforge generate --ckpt checkpoints/debug --prompt "ROMEO:" --prompt "JULIET:" --max_new_tokens 50
    kforge generate --ckpt checkpoints/debug --interactive --temperature 0.8 --top_p 0.95
    kforge generate --ckpt checkpoints/vlm_jd --image photo.jpg --prompt "A photo of"
    kforge generate --ckpt checkpoints/vlm_video --video clip.webm --prompt "A"

The checkpoint may have been saved by any number of processes (DCP reads it whole, see
:mod:`kempnerforge.checkpoint.load`). Decoding uses the KV cache of :mod:`kempnerforge.model.generate`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kempnerforge.cli_errors import ToolArgumentParser
from kempnerforge.errors import UserError

if TYPE_CHECKING:
    from kempnerforge.model.generate import SamplingConfig

# The checkpoint readers import Lightning (DCPCheckpointIO is its CheckpointIO) and the model: imported in the
# functions that run, so `kforge generate --help` and argument errors answer without them.


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``kforge generate``."""
    p = ToolArgumentParser(prog="kforge generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint directory, or the folder holding `latest`")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch (left-padded)")
    p.add_argument("--interactive", action="store_true", help="read prompts from stdin, one per line")
    p.add_argument(
        "--tokenizer", default=None, help="local tokenizer dir (default: the one the data was prepared with)"
    )
    p.add_argument("--max_new_tokens", type=int, default=64, help="tokens to generate per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens")
    p.add_argument("--image", default=None, help="image file for a vision-language checkpoint (every prompt sees it)")
    p.add_argument(
        "--video",
        default=None,
        help="video clip (.mp4, .webm, ...) for a vision-language checkpoint: frames sampled as in training "
        "(the checkpoint's data.sampling / fps / min_frames / max_frames), every prompt sees them",
    )
    return p


def load_tokenizer(path: str | None):
    """``AutoTokenizer`` from a local directory (never downloads).

    Raises:
        UserError: (a ValueError) no directory given and none recorded in the checkpoint.
    """
    if path is None:
        raise UserError("--tokenizer", "no tokenizer: pass --tokenizer DIR (the checkpoint records none)")
    from transformers import AutoTokenizer  # local import: transformers is slow to import

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def run_batch(model, tokenizer, prompts: list[str], sampling: SamplingConfig, ignore_eos: bool, device) -> None:
    """Generate for ``prompts`` and print each completion, then the throughput line."""
    from kempnerforge.model.generate import generate, left_pad

    eos = None if ignore_eos else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    ids, mask = left_pad([tokenizer.encode(p) for p in prompts], pad)
    out = generate(model, ids.to(device), mask.to(device), sampling, eos_token_id=eos, pad_token_id=pad)
    for i, prompt in enumerate(prompts):
        print(f"--- [{i}] {prompt}{tokenizer.decode(out.row(i))}")
    print(f"generated {int(out.lengths.sum())} tokens in {out.seconds:.2f} s ({out.tokens_per_s:.1f} tokens/s)")


def _lines(stream: Iterable[str]) -> Iterable[str]:
    for line in stream:
        line = line.rstrip("\n")
        if line.strip():
            yield line


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before the checkpoint is read, an empty prompt, a ``--tokenizer`` that is no local folder (it would be
    looked up as a Hub repo id) and ``--device cuda`` on a torch without CUDA (``parser.error``: one line, exit 2)."""
    if any(not p.strip() for p in args.prompt):
        parser.error("--prompt: a prompt is empty; give text to continue")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        parser.error(f"--tokenizer: {args.tokenizer} is not a local tokenizer folder (nothing is downloaded)")
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device: {args.device} is not available (this torch has no CUDA device); use --device cpu")


def generate_main(argv: list[str] | None = None) -> None:
    """Entry point of ``kforge generate`` (see the module docstring).

    Raises:
        SystemExit: neither ``--prompt`` nor ``--interactive`` given, or a bad sampling argument.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.prompt and not args.interactive:
        parser.error("give --prompt (repeatable) or --interactive")
    _check_arguments(parser, args)
    from kempnerforge.checkpoint.convert import dtype_from_name
    from kempnerforge.checkpoint.load import is_vlm_checkpoint, load_checkpoint_model
    from kempnerforge.model.generate import SamplingConfig

    try:
        sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
        dtype = dtype_from_name(args.dtype)
    except ValueError as err:
        parser.error(str(err))
    if args.image is not None and args.video is not None:
        parser.error("give --image or --video, not both")
    if is_vlm_checkpoint(args.ckpt):
        if args.image is None and args.video is None:
            parser.error("this is a vision-language checkpoint: give --image PATH or --video PATH")
        return _generate_vlm(args, sampling)
    if args.image is not None or args.video is not None:
        parser.error("--image / --video need a vision-language checkpoint (kempnerforge.module.VisionLanguage)")
    loaded = load_checkpoint_model(args.ckpt, device=args.device, dtype=dtype)
    tokenizer = load_tokenizer(args.tokenizer or loaded.tokenizer)
    print(f"loaded {loaded.path} ({loaded.config.num_params() / 1e6:.1f}M parameters) on {args.device}")
    if args.prompt:
        run_batch(loaded.model, tokenizer, args.prompt, sampling, args.ignore_eos, args.device)
    if args.interactive:
        print("one prompt per line; end with Ctrl-D", file=sys.stderr)
        for line in _lines(sys.stdin):
            run_batch(loaded.model, tokenizer, [line], sampling, args.ignore_eos, args.device)


def _generate_vlm(args: argparse.Namespace, sampling: SamplingConfig) -> None:
    """``--image`` / ``--video``: one image or clip for every prompt, through
    :func:`~kempnerforge.model.vlm_generate.generate_with_image` (a clip is ``frames x n_visual`` tokens)."""
    from kempnerforge.checkpoint.load import load_vlm_checkpoint
    from kempnerforge.config.vision import VisionEncoderConfig
    from kempnerforge.model.vision import build_image_processor
    from kempnerforge.model.vlm_generate import check_generatable, generate_with_image

    loaded = load_vlm_checkpoint(args.ckpt, device=args.device)
    try:
        check_generatable(loaded.model.backbone)
    except ValueError as err:
        raise SystemExit(f"kforge generate: {err}") from err
    tokenizer = load_tokenizer(args.tokenizer or loaded.tokenizer)
    processor = build_image_processor(VisionEncoderConfig(**loaded.meta["hyper_parameters"]["encoder"]))
    frames = _video_frames(args.video, loaded.meta) if args.video is not None else [_image(args.image)]
    print(f"loaded {loaded.path} ({loaded.config.num_params() / 1e6:.1f}M backbone parameters) on {args.device}")
    prompts = list(args.prompt) if args.prompt else [line for line in _lines(sys.stdin)]
    pixels = processor(images=frames, return_tensors="pt")["pixel_values"].float().to(args.device)
    if args.video is not None:  # one clip (1, frames, 3, H, W), the same for every prompt
        pixels = pixels[None].expand(len(prompts), *pixels.shape)
    else:
        pixels = pixels.expand(len(prompts), *pixels.shape[1:])
    eos = None if args.ignore_eos else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    out = generate_with_image(loaded.model, [tokenizer.encode(p) for p in prompts], pixels, sampling, eos, pad)
    for i, prompt in enumerate(prompts):
        print(f"--- [{i}] {prompt}{tokenizer.decode(out.row(i))}")
    print(f"generated {int(out.lengths.sum())} tokens in {out.seconds:.2f} s ({out.tokens_per_s:.1f} tokens/s)")


def _image(path: str):
    from PIL import Image

    try:
        return Image.open(path).convert("RGB")
    except OSError as err:
        raise SystemExit(f"kforge generate: cannot read --image {path!r}: {err}") from err


def _video_frames(path: str, meta: dict) -> list:
    """The clip's frames chosen as the checkpoint's training data chose them (defaults without a video datamodule)."""
    from kempnerforge.data.video_decode import VideoDecodeError, read_frames
    from kempnerforge.data.video_sampling import FrameSampling, sample_frames

    data = meta.get("datamodule_hyper_parameters") or {}
    keys = {"sampling": "policy", "fps": "fps", "min_frames": "min_frames", "max_frames": "max_frames"}
    cfg = FrameSampling(**{field: data[key] for key, field in keys.items() if key in data},
                        num_frames=data.get("num_frames"))  # fmt: skip
    try:
        frames, times = read_frames(path, lambda ts: sample_frames(ts, cfg), where=path)
    except (VideoDecodeError, OSError) as err:
        raise SystemExit(f"kforge generate: cannot decode --video {path!r}: {err}") from err
    print(f"--video {path}: {len(frames)} frames at {', '.join(f'{t:.2f}' for t in times)} s ({cfg.policy})")
    return frames
