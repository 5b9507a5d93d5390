"""A context in which ``transformers`` reads a folder without logging: the converters and ``model.init_from`` turn
its failures into one-line refusals, which its load report, config warnings and progress bars would precede."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def quiet_transformers():
    """transformers logs only errors and shows no progress bar inside (its load report and config warnings would
    precede our one-line refusal, which says the same); both are restored after."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
