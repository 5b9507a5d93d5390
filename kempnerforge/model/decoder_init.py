"""The decoder's initialization rules, shared by the dense/MoE :class:`~kempnerforge.model.Transformer` and every
VLM backbone (joint decoder, cross-attention, MoT, MoMa), so they cannot drift apart.

The rules follow Llama / GPT-2 practice as torchtitan applies it: RMSNorm weights ones; Linear and Embedding weights
and packed expert weights N(0, init_std**2) truncated at +-3 std; residual-branch outputs at
init_std / sqrt(2 * n_layers) (GPT-2, Radford et al. 2019, section 2.3); a fused ``wqkv`` / ``w13`` gets, element by
element, the values of the separate projections it joins. Every element is a function of (seed, FQN,
its global index) (:mod:`kempnerforge.model.init`'s counter-based generator): each rank generates only its own shard,
on the parameter's device, and the result is independent of the global RNG, of meta or eager builds and of the
FSDP2 / TP / EP / PP layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.fused import layout_rows, part_sizes, unfused_names
from kempnerforge.model.init import canonical_fqn, ones_init_, trunc_normal_init_
from kempnerforge.model.moe import GroupedExperts, MoE
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import model_rope_tables

#: Linear weights on a residual branch's output (FQN without ``.weight``): attention and MLP outputs, cross-attention
#: and cross-MLP outputs (``cross_attention.wo``, ``cross_feed_forward.w2``) and shared experts' ``w2``. Packed routed
#: experts' ``w2`` is residual by its parameter name.
RESIDUAL_OUT = re.compile(r"(attention\.wo|feed_forward\.w2|moe\.shared_experts\.\d+\.w2)$")


def _fused_parts(fqn: str, weight: torch.Tensor, config: ModelConfig) -> tuple:
    """``(concat, rows)`` for a fused projection (every element drawn as in its separate ``wq``/``wk``/``wv`` or
    ``w1``/``w3``, so a fused model starts bit-identical to the unfused one), ``()`` for any other weight."""
    found = unfused_names(fqn)
    if found is None:
        return ()
    names, kind = found
    n = weight.shape[0]
    return tuple(zip(names, part_sizes(kind, config, n), strict=True)), layout_rows(kind, config, n)


@torch.no_grad()
def init_decoder_(
    model: nn.Module,
    config: ModelConfig,
    seed: int,
    *,
    seed_fqn: Callable[[str], str] = lambda fqn: fqn,
    done: set[int] | None = None,
) -> None:
    """Initialize every parameter of ``model`` and its RoPE tables in place, by the rules in the module docstring.

    ``model`` must hold ``rope_cos`` / ``rope_sin`` buffers (max_seq_len, head_dim // 2); the tables (replicated
    buffers, O(max_seq_len * head_dim)) are computed on CPU in fp32 and copied (bitwise the same on every device). MoE routers' selection bias (``expert_bias``) is
    zeroed (unless in ``done``), and so are Linear biases (q/k/v with ``attention_bias``). A tied head is initialized once, under the embedding's FQN (modules are visited in registration order).

    Args:
        model: the decoder (plain tensors or DTensors; each rank writes its own shard).
        config: its :class:`ModelConfig` (``init_std``, ``n_layers``, RoPE settings).
        seed: the run's init seed.
        seed_fqn: canonical parameter FQN -> the FQN whose seed it draws from (MoT maps every modality's copy to
            the dense model's FQN, so each modality starts as the text model).
        done: ids of parameters the caller already initialized (e.g. zero gates); skipped here.

    Raises:
        RuntimeError: a parameter no rule covers (a new module type), naming them.
    """
    cos, sin = model_rope_tables(config, "cpu")
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)
    std, residual_std = config.init_std, config.init_std / math.sqrt(2 * config.n_layers)
    done = set() if done is None else done
    for name, module in model.named_modules():
        if isinstance(module, MoE) and id(module.router.expert_bias) not in done:  # not one read from a folder
            module.router.expert_bias.zero_()
        if isinstance(module, GroupedExperts):
            weights = {p: getattr(module, p) for p in ("w1", "w2", "w3")}
        elif isinstance(module, RMSNorm | nn.Linear | nn.Embedding):
            weights = {"weight": module.weight}
            if isinstance(module, nn.Linear) and module.bias is not None and id(module.bias) not in done:
                module.bias.zero_()  # q/k/v biases (attention_bias): zeros, as torchtitan and HF Qwen 2 init them
                done.add(id(module.bias))
        else:
            continue
        for pname, weight in weights.items():
            if id(weight) in done:  # a tied head (already the embedding) or a caller's own rule
                continue
            fqn = seed_fqn(canonical_fqn(f"{name}.{pname}"))
            if isinstance(module, RMSNorm):
                ones_init_(weight)
            else:
                experts = isinstance(module, GroupedExperts)
                residual = pname == "w2" if experts else RESIDUAL_OUT.search(fqn.removesuffix(".weight")) is not None
                trunc_normal_init_(
                    weight, fqn, seed, residual_std if residual else std, *_fused_parts(fqn, weight, config)
                )
            done.add(id(weight))
    missed = [n for n, p in model.named_parameters() if id(p) not in done]
    if missed:
        raise RuntimeError(f"{type(model).__name__}.init_weights has no rule for parameters {missed}")
