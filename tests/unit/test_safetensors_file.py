"""Issue 30, item 3: one safetensors file opened once (``SafetensorsFile``): its views equal what ``safetensors``
itself loads, a damaged header or data buffer is refused naming the file, and ``drop`` unmaps the pages a read
mapped (the file's resident pages in ``/proc/self/smaps`` fall back to 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kempnerforge.model.safetensors_file import SafetensorsFile


def _mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path``."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                current = parts[5] if len(parts) > 5 else None
            elif parts[0] == "Rss:" and current == str(path):
                total += int(parts[1])
    return total


def test_views_equal_safetensors_own_load(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(5, 7, generator=gen),
        "b": torch.randn(3, 4, generator=gen).to(torch.bfloat16),
        "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "m": torch.tensor([True, False, True]),
        "f8": torch.randn(4, generator=gen).to(torch.float8_e4m3fn),
        "s": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    want = {key: t.clone() for key, t in load_file(str(path)).items()}  # not views of safetensors' own mapping
    file = SafetensorsFile(path)
    assert sorted(file.keys()) == sorted(tensors)
    for key, tensor in want.items():
        view = file.view(key)
        assert file.shape(key) == tuple(tensor.shape) and view.dtype == tensor.dtype, key
        assert torch.equal(view.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), (
            key
        )  # bitwise, float8 included
    kept = file.view("w")[1:3, 2:5]
    assert torch.equal(kept, want["w"][1:3, 2:5])
    del view
    file.close()  # a view is still alive: the mapping stays until it is gone
    assert torch.equal(kept, want["w"][1:3, 2:5])
    assert str(path) in Path("/proc/self/maps").read_text()
    del kept
    assert str(path) not in Path("/proc/self/maps").read_text()  # unmapped, its descriptor closed


@pytest.mark.parametrize(
    "damage, pattern",
    [
        (lambda data: data[:-1], "not fully covered.*truncated or grown"),
        (lambda data: data + b"\0" * 8, "not fully covered.*truncated or grown"),
        (lambda data: data[:6], "not a safetensors file"),
        (lambda data: (10**9).to_bytes(8, "little") + data[8:], "header of 1000000000 bytes"),
        (lambda data: data[:8] + b"x" + data[9:], "header does not parse"),
        (lambda data: (8).to_bytes(8, "little") + b"[1]     ", "header does not parse"),
        (lambda data: data.replace(b'"shape"', b'"shapf"', 1), "header does not parse"),
    ],
)
def test_a_damaged_file_is_refused_naming_it(tmp_path, damage, pattern):
    path = tmp_path / "bad.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(3)}, str(path))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=pattern) as err:
        SafetensorsFile(path)
    assert str(path) in str(err.value)


def test_an_unknown_dtype_is_refused_by_name(tmp_path):
    path = tmp_path / "f4.safetensors"
    save_file({"a": torch.ones(2, 2)}, str(path))
    data = path.read_bytes().replace(b'"F32"', b'"F4" ', 1)  # same header length
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"tensor 'a' has dtype 'F4'"):
        SafetensorsFile(path)


def test_drop_unmaps_the_pages_a_read_mapped(tmp_path):
    """8 MiB rows, a column block (every row's pages) and a strided block: each read maps pages of the file, and
    after ``drop`` none stays resident (fault-around and large folios included)."""
    path = tmp_path / "big.safetensors"
    save_file({"a": torch.randn(2048, 1024), "b": torch.randn(2048, 1024)}, str(path))
    file = SafetensorsFile(path)
    for key, index in [("a", (slice(0, 1024),)), ("a", (slice(None), slice(0, 256))), ("b", (slice(1, None, 2),))]:
        block = file.view(key)[index]
        out = block.clone()
        assert _mapped_kib(path) >= out.nbytes // 1024 // 2, key  # the copy went through the mapping
        file.drop(block)
        assert _mapped_kib(path) == 0, (key, index)
    file.close()
