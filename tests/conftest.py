"""Shared fixtures: real data paths and a small token shard set prepared once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "data" / "tinyshakespeare" / "input.txt"
GPT2_TOKENIZER = REPO / "data" / "tokenizers" / "gpt2"


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests on machines without CUDA (never delete them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shakespeare_text() -> Path:
    """The bundled tiny-shakespeare text (1.1 MB)."""
    return SHAKESPEARE


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir() -> Path:
    """The bundled GPT-2 tokenizer directory (vocab 50257, EOS 50256)."""
    return GPT2_TOKENIZER


@pytest.fixture(scope="session")
def shakespeare_tokens(tmp_path_factory) -> Path:
    """The first ~100 KB of tiny-shakespeare tokenized with GPT-2 into memmap shards (~25k tokens)."""
    from kempnerforge.data.prepare import prepare_data

    root = tmp_path_factory.mktemp("tokens")
    src = root / "shakespeare_head.txt"
    src.write_text(SHAKESPEARE.read_text()[:100_000])
    out = root / "shakespeare"
    prepare_data(source=str(src), tokenizer=str(GPT2_TOKENIZER), output_dir=str(out))
    return out


@pytest.fixture(scope="session", autouse=True)
def _kforge_cache_dir(tmp_path_factory):
    """The CPU matmul peak (kempnerforge.metrics.peak) is cached per user: tests (and the kforge processes they
    start, which inherit the environment) measure it once per session into a folder of their own."""
    if "KFORGE_CACHE_DIR" not in os.environ:
        os.environ["KFORGE_CACHE_DIR"] = str(tmp_path_factory.mktemp("kforge_cache"))


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    """Kill what a test's ``start``-ed ``kforge`` runs left alive (a failure or a pytest-timeout mid-run)."""
    yield
    from tests.e2e.preempt_helpers import kill_started

    kill_started()


@pytest.fixture(autouse=True)
def _one_thread_per_test_process(monkeypatch):
    """Distributed launches share 2 cores: keep each rank single-threaded (see NOTES-platform.md)."""
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


#: What a launcher (or Lightning's environment, for an in-process ``Trainer.fit``) writes into ``os.environ``.
_LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK")  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def _launcher_env_baseline() -> dict[str, str | None]:
    """The launcher variables as the pytest process started with them (normally none)."""
    return {key: os.environ.get(key) for key in _LAUNCHER_ENV}


@pytest.fixture(autouse=True)
def _launcher_env_restored(_launcher_env_baseline):
    """An in-process ``Trainer.fit`` leaves Lightning's ``MASTER_PORT`` (and friends) in ``os.environ``; a ``kforge``
    subprocess a later test starts would inherit it and try to open its rendezvous on a port that may still be
    held (EADDRINUSE). After each test they are put back as the session started; not as the test found them,
    because a module-scoped fixture that trains in-process runs before this fixture's setup."""
    yield
    for key, value in _launcher_env_baseline.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
