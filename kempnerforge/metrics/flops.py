"""Training FLOPs per token for MFU (model FLOPs utilization).

PaLM convention (Chowdhery et al., arXiv:2204.02311, appendix B; also torchtitan and nanoGPT):
one token costs ``6 * N`` FLOPs for the matmuls of its N active weights (2 forward + 4 backward
per weight) plus ``12 * n_layers * dim * seq_len`` for the attention score and value matmuls
(QK^T and AV, forward and backward, the causal mask not discounted). Pure arithmetic: no torch,
so configs can call it.

Extra trained parts (a VLM's vision encoder and connector) add their own terms: call
:func:`transformer_flops_per_token` for each trained tower and :func:`sum_flops_per_token` for the
total; frozen parts are left out (their forward costs FLOPs, but MFU counts what is trained).
"""

from __future__ import annotations


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def transformer_flops_per_token(active_params: int, n_layers: int, dim: int, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token of one transformer tower, FLOP/token.

    ``6 * active_params + 12 * n_layers * dim * seq_len``.

    Args:
        active_params: weights used in a matmul for each token: non-embedding parameters plus the
            output head (also when tied, since the head matmul runs). For MoE only the experts a token
            is routed to count (see :func:`moe_active_params`).
        n_layers: transformer blocks.
        dim: attention width (n_heads * head_dim), channels.
        seq_len: tokens per sequence (the attention term grows with it).

    Raises:
        ValueError: any argument not a positive integer (names the argument).
    """
    for name, value in (("active_params", active_params), ("n_layers", n_layers), ("dim", dim), ("seq_len", seq_len)):
        _positive_int(name, value)
    return 6 * active_params + 12 * n_layers * dim * seq_len


def moe_active_params(
    total_params: int, n_moe_layers: int, num_experts: int, top_k: int, params_per_expert: int
) -> int:
    """Parameters a token actually uses in a Mixture-of-Experts model.

    ``total_params - n_moe_layers * (num_experts - top_k) * params_per_expert``: every dense
    parameter (attention, norms, router, shared experts, head) is used, but of each MoE layer's
    ``num_experts`` routed experts only ``top_k`` run for a token (Switch Transformer,
    arXiv:2101.03961; DeepSeek-V3, arXiv:2412.19437, counts "activated parameters" the same way).

    Args:
        total_params: all matmul parameters counted as for a dense model (every expert included).
        n_moe_layers: blocks whose MLP is a routed MoE layer.
        num_experts: routed experts per MoE layer.
        top_k: experts each token is sent to (1 <= top_k <= num_experts).
        params_per_expert: parameters of one routed expert (SwiGLU: 3 * dim * expert_hidden).

    Raises:
        ValueError: a non-positive count, ``top_k`` > ``num_experts``, or a result that is not
            positive (the expert parameters exceed ``total_params``).
    """
    for name, value in (
        ("total_params", total_params),
        ("n_moe_layers", n_moe_layers),
        ("num_experts", num_experts),
        ("top_k", top_k),
        ("params_per_expert", params_per_expert),
    ):
        _positive_int(name, value)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} must be <= num_experts={num_experts}")
    active = total_params - n_moe_layers * (num_experts - top_k) * params_per_expert
    if active <= 0:
        raise ValueError(
            f"total_params={total_params} is smaller than the inactive expert parameters "
            f"{n_moe_layers} * ({num_experts} - {top_k}) * {params_per_expert}: count every expert in total_params"
        )
    return active


def sum_flops_per_token(*terms: int) -> int:
    """Total training FLOP/token of the trained parts (decoder, plus e.g. a trained vision encoder and
    connector, each already scaled to FLOPs per decoder token).

    Raises:
        ValueError: no terms, or a term that is negative or not an integer.
    """
    if not terms:
        raise ValueError("sum_flops_per_token needs at least one term")
    for i, t in enumerate(terms):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"sum_flops_per_token term {i}={t!r} must be a non-negative integer")
    return sum(terms)


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak_flops_per_device: float) -> float:
    """Model FLOPs utilization, a fraction in [0, 1] on a healthy run.

    ``tokens_per_s_per_device * flops_per_token / peak_flops_per_device`` (PaLM, appendix B).

    Raises:
        ValueError: ``peak_flops_per_device`` not positive.
    """
    if not peak_flops_per_device > 0:
        raise ValueError(f"peak_flops_per_device={peak_flops_per_device!r} must be > 0 (FLOP/s)")
    return tokens_per_s_per_device * flops_per_token / peak_flops_per_device
