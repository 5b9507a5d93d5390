"""lm-evaluation-harness on a kempnerforge checkpoint (EleutherAI ``lm_eval``, optional dependency).

The harness's own ``HFLM`` runs the model: the checkpoint is exported once with :func:`dcp_to_hf`
(float32 by default) into a folder, and ``HFLM`` loads that folder with its tokenizer, so the
scores are those of the exported ``transformers`` model (equal to ours within 1e-5 in logits)::

    from lm_eval import simple_evaluate
    from kempnerforge.tools.lm_eval_adapter import checkpoint_lm
    results = simple_evaluate(model=checkpoint_lm("checkpoints/debug", "/tmp/debug-hf"), tasks=["hellaswag"])

Equivalent from the shell: ``kforge convert dcp-to-hf --ckpt checkpoints/debug --output_dir /tmp/debug-hf``
then ``lm_eval --model hf --model_args pretrained=/tmp/debug-hf,dtype=float32 --tasks hellaswag``.
Tasks download their datasets unless they are cached or point at local files.
"""

from __future__ import annotations

from pathlib import Path

from kempnerforge.checkpoint.convert import dcp_to_hf


def checkpoint_lm(
    ckpt: str | Path,
    export_dir: str | Path,
    tokenizer: str | Path | None = None,
    dtype: str = "float32",
    batch_size: int = 8,
    device: str = "cpu",
):
    """An ``lm_eval`` model (``lm_eval.models.huggingface.HFLM``) for a kempnerforge checkpoint.

    Args:
        ckpt: checkpoint directory or the folder holding ``latest``.
        export_dir: where the ``transformers`` export is written (reused by later calls).
        tokenizer: tokenizer directory to copy (default: the one the training data was prepared with).
        dtype: export dtype (float32, bfloat16, float16).
        batch_size, device: passed to ``HFLM``.

    Raises:
        ImportError: ``lm_eval`` is not installed (``pip install lm_eval``).
        ValueError: a model with no HF equivalent, or no tokenizer known.
    """
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("checkpoint_lm needs lm-evaluation-harness: pip install lm_eval") from err
    out = dcp_to_hf(ckpt, export_dir, dtype=dtype, tokenizer=tokenizer, overwrite=True)  # reused: replaced whole
    if not any(out.glob("tokenizer*")) and not (out / "vocab.json").is_file():
        raise ValueError(f"no tokenizer in {out}: pass tokenizer=DIR (the checkpoint records none)")
    return HFLM(pretrained=str(out), tokenizer=str(out), dtype=dtype, batch_size=batch_size, device=device)
