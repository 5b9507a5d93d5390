"""Issue 9 check 3: a checkpoint saved by 2 processes (FSDP2, dp_shard=2) generates and converts in 1 process.

Oracle for the weights: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (DCP's own
whole-checkpoint reader); for generation and export: ``transformers`` on the exported directory.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kempnerforge.checkpoint.convert import dcp_to_hf
from kempnerforge.checkpoint.load import load_checkpoint_model
from kempnerforge.model.generate import SamplingConfig, generate, left_pad
from tests.distributed.launch import train

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_two_process_fsdp_checkpoint_generates_and_converts_in_one_process(shakespeare_tokens, tmp_path):
    ckpt = tmp_path / "ckpt"
    train(2, shakespeare_tokens, tmp_path / "run.json", "--steps", "3", "--ckpt-dir", str(ckpt), "--ckpt-every", "3")
    assert "world_size=2" in (ckpt / "step=0003.ckpt" / "COMPLETE").read_text()

    loaded = load_checkpoint_model(ckpt)  # this process has no process group
    assert not torch.distributed.is_initialized()
    dcp_to_torch_save(ckpt / "step=0003.ckpt", tmp_path / "whole.pt")
    whole = _flat(torch.load(tmp_path / "whole.pt", weights_only=True))
    ours = loaded.model.state_dict()
    for key, value in ours.items():
        assert torch.equal(value, whole[f"state_dict.model.{key}"]), key

    out = dcp_to_hf(ckpt, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    ids, mask = left_pad([[464, 3290, 318], [15496, 11, 995, 0, 1867]], pad_token_id=50256)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, loaded.model(ids), rtol=0, atol=1e-5)
    mine = generate(loaded.model, ids, mask, SamplingConfig(max_new_tokens=8))
    theirs = hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=50256)  # fmt: skip
    assert torch.equal(mine.tokens, theirs[:, ids.shape[1] :])
