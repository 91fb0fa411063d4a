"""The state dict every checkpoint benchmark saves (ours and the anchors'): torch only."""

from __future__ import annotations

from typing import Any

import torch

TENSOR_BYTES = 16 << 20


def make_state(nbytes: int, seed: int = 0) -> dict[str, Any]:
    """A model-and-optimizer-like state dict of about ``nbytes`` (16 MiB float32 tensors)."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // TENSOR_BYTES)
    model = {f"layer{i}.weight": torch.randn(TENSOR_BYTES // 4, generator=gen) for i in range(n)}
    for i in range(32):
        model[f"norm{i}.bias"] = torch.randn(1024, generator=gen)
    return {
        "model": model,
        "optimizer": {
            "state": {i: {"step": torch.tensor(100.0)} for i in range(64)},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(range(64))}],
        },
        "rng": torch.get_rng_state(),
        "step": 100,
    }


def state_bytes(state: dict[str, Any]) -> int:
    """Tensor bytes of a state made by ``make_state``."""
    return sum(t.numel() * t.element_size() for t in state["model"].values())
