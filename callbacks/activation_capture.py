"""Forward hooks on named layers: detached activations (and attention probabilities) saved to .npz."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.tensor import DTensor
from typing_extensions import override

from kempnerforge.model.attention import Attention
from kempnerforge.model.hooks import attention_probs


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, list | tuple):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    return None


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):  # tensor/sequence-parallel outputs: gather the full tensor
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


class ActivationCapture(Callback):
    """Records the outputs of named modules during chosen training steps and saves them per step.

    Forward hooks are attached only for the listed steps (no cost otherwise). Each hook stores the
    module's output (the first tensor of a tuple) detached and copied to CPU, so device memory is
    not held. ``attention_layers`` name :class:`~kempnerforge.model.attention.Attention` modules whose
    causal probabilities are recomputed explicitly (:func:`kempnerforge.model.hooks.attention_probs`,
    ``(batch, n_heads, seq, seq)``); SDPA never materializes them. After a captured step every rank
    writes ``dirpath/activations_step{S}_rank{R}.npz`` with one array per name (attention entries
    are keyed ``<name>.attn_probs``); float arrays keep their dtype except bfloat16, saved as float32
    (numpy has no bfloat16). Micro-batches of one step (gradient accumulation) are concatenated
    along dim 0. Names are module names relative to the LightningModule (``model.layers.0``).

    Args:
        layers: module names whose outputs are captured.
        attention_layers: Attention module names whose probabilities are captured.
        steps: global steps to capture (the step about to run, 0 = first).
        dirpath: output folder (created).

    Raises:
        ValueError: no names given or a negative step; at ``setup``, a name that is not a module of
            the LightningModule, or an attention name that is not an ``Attention`` module.
    """

    def __init__(
        self,
        layers: list[str] | None = None,
        attention_layers: list[str] | None = None,
        steps: list[int] | None = None,
        dirpath: str = "activations",
    ) -> None:
        self.layers = list(layers or [])
        self.attention_layers = list(attention_layers or [])
        if not self.layers and not self.attention_layers:
            raise ValueError("ActivationCapture needs at least one name in layers or attention_layers")
        self.steps = set(steps if steps is not None else [0])
        if any(not isinstance(s, int) or s < 0 for s in self.steps):
            raise ValueError(f"ActivationCapture.steps={sorted(self.steps)!r} must be non-negative integers")
        self.dirpath = Path(dirpath)
        self.saved: list[Path] = []
        self._handles: list[Any] = []
        self._store: dict[str, list[torch.Tensor]] = {}
        self._capture_step: int | None = None

    def _modules(self, pl_module: LightningModule) -> dict[str, torch.nn.Module]:
        named = dict(pl_module.named_modules())
        # Wrappers (activation checkpointing, torch.compile) insert name parts; accept the canonical name.
        canon = {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): m for n, m in named.items()}
        found = {}
        for name in [*self.layers, *self.attention_layers]:
            module = named.get(name, canon.get(name))
            if module is None:
                sample = [n for n in canon if n][:8]
                raise ValueError(f"ActivationCapture: no module named {name!r}; module names look like {sample}")
            found[name] = module
        for name in self.attention_layers:
            if not isinstance(found[name], Attention):
                raise ValueError(
                    f"ActivationCapture.attention_layers: {name!r} is a {type(found[name]).__name__}, not a "
                    "kempnerforge Attention module (attention probabilities need its explicit path)"
                )
        return found

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve and check the names once the model is built."""
        self._modules(pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Attach the hooks for a captured step."""
        if trainer.global_step not in self.steps or self._handles:
            return
        modules = self._modules(pl_module)
        self._capture_step = trainer.global_step
        for name in self.layers:
            self._handles.append(modules[name].register_forward_hook(self._output_hook(name)))
        for name in self.attention_layers:
            self._handles.append(modules[name].register_forward_hook(self._attention_hook(name)))

    def _output_hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            t = _first_tensor(output)
            if t is not None:
                self._store.setdefault(name, []).append(_to_cpu(t))

        return hook

    def _attention_hook(self, name: str):
        def hook(module: Attention, args: tuple, output: Any) -> None:
            x, cos, sin = (a.full_tensor() if isinstance(a, DTensor) else a for a in args[:3])
            self._store.setdefault(f"{name}.attn_probs", []).append(_to_cpu(attention_probs(module, x, cos, sin)))

        return hook

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the step's last micro-batch: remove the hooks and save the captured arrays."""
        # global_step moves past the captured step only after its optimizer step (last micro-batch).
        if not self._handles or trainer.global_step == self._capture_step:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        step = self._capture_step
        arrays = {}
        for key, chunks in self._store.items():
            t = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            arrays[key] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
        self._store = {}
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = self.dirpath / f"activations_step{step}_rank{trainer.global_rank}.npz"
        np.savez(path, **arrays)
        self.saved.append(path)
