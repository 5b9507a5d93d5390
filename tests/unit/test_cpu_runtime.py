"""CPU runtime choices of KempnerStrategy: FSDP2 skipped on a one-rank fp32 mesh; glibc freed-memory reuse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.parallel.fsdp import apply_fsdp, is_fsdp_applied
from kempnerforge.strategies import cpu_malloc

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, multiple_of=16)

# Pure ctypes (no torch import) so the subprocess starts in well under a second; the module is loaded
# from its file so the strategy package (Lightning, torch) is not imported either.
_FAULTS = """
import ctypes, importlib.util, resource, sys
if sys.argv[1] == "keep":
    spec = importlib.util.spec_from_file_location("cpu_malloc", sys.argv[2])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 * 2**20  # 64 MiB, above glibc's mmap threshold
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)  # touch every page, as a tensor fill does
    libc.free(p)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    path = str(Path(cpu_malloc.__file__))
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode, path], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keep_freed_memory_stops_refaulting_large_blocks():
    # 10 x 64 MiB = 163,840 fresh 4 KiB pages when each block is mmapped and unmapped; ~1 block's worth when kept.
    default, keep = _faults("default"), _faults("keep")
    assert default > 100_000, default
    assert keep < default / 4, (keep, default)


def test_fsdp_is_skipped_on_a_one_rank_fp32_mesh_and_kept_for_bf16(gloo_world_1):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    plain = Transformer(CFG)
    apply_fsdp(plain, mesh, param_dtype=torch.float32)
    assert is_fsdp_applied(plain) and not isinstance(plain, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    mixed = Transformer(CFG)
    apply_fsdp(mixed, mesh, param_dtype=torch.bfloat16)  # FSDP2's MixedPrecisionPolicy does the casting
    assert isinstance(mixed, FSDPModule) and isinstance(mixed.layers["0"], FSDPModule)
