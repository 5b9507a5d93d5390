"""``kforge eval``: perplexity of a checkpoint on token data, on one device without a process group.

    kforge eval --ckpt checkpoints/debug                     # the run's own validation split
    kforge eval --ckpt checkpoints/debug --data_dir data/tokens/other --split all
    kforge eval --ckpt checkpoints/debug --source corpus.jsonl --tokenizer data/tokenizers/gpt2

Data defaults (``data_dir``, ``seq_len``, ``val_fraction``) come from the checkpoint's data module,
so the default is the held-out split training validated on, and the result equals
``exp(val/loss)`` of that run. ``--source`` takes anything ``kforge prepare-data`` reads (text,
jsonl, parquet, a ``datasets.save_to_disk`` folder): it is tokenized into a temporary memmap first.

Perplexity = exp(total next-token cross-entropy / number of target tokens), over non-overlapping
windows of ``seq_len + 1`` tokens (the training layout). For benchmark tasks use lm-evaluation-harness
on a converted checkpoint (``kforge convert dcp-to-hf``, then ``lm_eval --model hf
--model_args pretrained=<dir>``; see docs/how-to/generate-convert-eval.md).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from kempnerforge.cli_errors import ToolArgumentParser
from kempnerforge.errors import UserError
from kempnerforge.training.loss import IGNORE_INDEX, token_cross_entropy_sum

# The checkpoint reader and the data module import Lightning: imported in the functions that run, so
# `kforge eval --help` and argument errors answer without it.

SPLITS = ("val", "train", "all")


@dataclass
class PerplexityResult:
    """Token-weighted evaluation result: ``loss`` nats/token, ``perplexity`` = exp(loss), ``tokens`` counted."""

    loss: float
    perplexity: float
    tokens: int


@torch.no_grad()
def perplexity(
    model: torch.nn.Module, loader: DataLoader, device: torch.device | str = "cpu", loss_chunk_size: int = 0
) -> PerplexityResult:
    """Mean next-token cross-entropy (fp32, summed then divided by the token count) and its exp.

    The loss is computed as training computed it (``CausalLM``'s validation path): with
    ``loss_chunk_size > 0`` the output head and cross-entropy run over chunks of that many tokens
    (:mod:`kempnerforge.training.chunked_ce`), so the full ``(batch, seq, vocab)`` fp32 logits never exist.
    Sums stay on the device; the host reads them once at the end.

    Args:
        model: maps input_ids (batch, seq) to logits (batch, seq, vocab); with ``loss_chunk_size > 0`` a
            :class:`~kempnerforge.model.Transformer` (``model(ids, labels=..., loss_chunk_size=...)``).
        loader: yields ``{"input_ids", "labels"}`` (batch, seq); labels -100 are ignored.
        device: where the model runs.
        loss_chunk_size: tokens per chunk of the fused head + loss (0: full logits).

    Raises:
        ValueError: the loader yields no target token.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    for batch in loader:
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        if loss_chunk_size:
            loss_sum, _ = model(ids, labels=labels, loss_chunk_size=loss_chunk_size)
        else:
            loss_sum, _ = token_cross_entropy_sum(model(ids), labels)
        total += loss_sum.double()
        count += (labels != IGNORE_INDEX).sum()
    n = int(count)  # the one host read
    if n == 0:
        raise ValueError("perplexity: the data has no target tokens")
    loss = float(total) / n
    return PerplexityResult(loss, math.exp(loss), n)


def eval_windows(data_dir: str, seq_len: int, val_fraction: float, split: str, data_seed: int = 0):
    """The windows of ``split`` exactly as :class:`TokenDataModule` cuts them (``all``: every window).

    Raises:
        ValueError: ``split`` not in :data:`SPLITS`, or ``val`` with ``val_fraction == 0``.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; use one of {SPLITS}")
    if split == "all":
        val_fraction = 0.0
    from kempnerforge.data.datamodule import TokenDataModule

    dm = TokenDataModule(data_dir, seq_len=seq_len, micro_batch_size=1, val_fraction=val_fraction, data_seed=data_seed)
    dm.setup("validate")
    if split == "val":
        if dm.val_dataset is None:
            raise ValueError("split='val' needs val_fraction > 0 (the checkpoint's run had no validation split)")
        return dm.val_dataset
    return dm.train_dataset


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``kforge eval``."""
    p = ToolArgumentParser(prog="kforge eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint directory, or the folder holding `latest`")
    p.add_argument("--data_dir", default=None, help="memmap token shards (default: the run's data_dir)")
    p.add_argument("--source", default=None, help="text / jsonl / parquet / save_to_disk data to tokenize first")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for --source (default: the run's)")
    p.add_argument("--text_field", default="text", help="text column of --source")
    p.add_argument("--split", default=None, choices=SPLITS, help="default: val for the run's data, all for others")
    p.add_argument("--seq_len", type=int, default=None, help="tokens per window (default: the run's)")
    p.add_argument("--val_fraction", type=float, default=None, help="default: the run's")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument(
        "--loss_chunk_size", type=int, default=None, help="tokens per fused head+loss chunk (default: the run's)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def eval_main(argv: list[str] | None = None) -> PerplexityResult:
    """Entry point of ``kforge eval``; prints and returns the result."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from kempnerforge.checkpoint.load import load_checkpoint_model
    from kempnerforge.data.input_checks import check_source, check_tokenizer
    from kempnerforge.data.memmap import check_token_dir
    from kempnerforge.data.prepare import prepare_data

    # The data arguments before the checkpoint is read: a missing, empty or unprepared path is one line.
    if args.source is not None:
        check_source(args.source, "--source")
    if args.tokenizer is not None:
        check_tokenizer(args.tokenizer, "--tokenizer")
    if args.data_dir is not None and args.source is None:
        check_token_dir(args.data_dir, "--data_dir")

    loaded = load_checkpoint_model(args.ckpt, device=args.device)
    run = loaded.meta.get("datamodule_hyper_parameters") or {}
    seq_len = args.seq_len or run.get("seq_len")
    if seq_len is None:
        parser.error("--seq_len is needed (the checkpoint records no data module)")
    own_data = args.data_dir is None and args.source is None
    split = args.split or ("val" if own_data else "all")
    val_fraction = args.val_fraction if args.val_fraction is not None else run.get("val_fraction", 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or run.get("data_dir")
        if args.source is not None:
            tokenizer = args.tokenizer or loaded.tokenizer
            if tokenizer is None:
                parser.error("--source needs --tokenizer (the checkpoint records none)")
            try:
                prepare_data(source=args.source, tokenizer=tokenizer, output_dir=tmp, text_field=args.text_field)
            except UserError as err:  # "source produced no tokens", a bad tokenizer: named as the option
                raise UserError(f"--{err.field.removeprefix('--')}", str(err)) from err
            data_dir = tmp
        if data_dir is None:
            parser.error("--data_dir or --source is needed (the checkpoint records no data module)")
        if args.data_dir is None and args.source is None:
            check_token_dir(data_dir, "--data_dir")  # the run's, recorded in the checkpoint: it may have moved
        windows = eval_windows(data_dir, seq_len, val_fraction, split, run.get("data_seed", run.get("seed", 0)))
        chunk = args.loss_chunk_size
        if chunk is None:
            chunk = (loaded.meta.get("hyper_parameters") or {}).get("loss_chunk_size", 0)
        if chunk < 0:
            parser.error(f"--loss_chunk_size={chunk} must be >= 0 (0: full logits)")
        loader = DataLoader(windows, batch_size=args.batch_size)
        result = perplexity(loaded.model, loader, args.device, loss_chunk_size=chunk)
    print(f"{split} split of {data_dir if args.source is None else args.source}: loss {result.loss:.6f} nats/token, "
          f"perplexity {result.perplexity:.4f} over {result.tokens:,} tokens")  # fmt: skip
    return result
