"""Shared helpers for the flash-checkpoint tests: deep exact comparison, a training state."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality: types, dtypes, shapes, bits of every tensor and float, key order."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        if a.numel():
            bits_a = a.contiguous().reshape(-1).view(torch.uint8)
            bits_b = b.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(bits_a, bits_b), f"{path}: tensor bits differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        if hasattr(a, "_metadata") or hasattr(b, "_metadata"):
            assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or a.hex() == b.hex(), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def training_state(seed: int = 0, width: int = 64) -> dict[str, Any]:
    """Model + Adam state after a step, plus torch, python and numpy RNG states."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 3)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(4, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    random.seed(seed)
    np.random.seed(seed)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
        "epoch": 3,
        "loss": 0.1 + 0.2,
    }


def mount_small_tmpfs(path: str, size: str = "4m") -> str | None:
    """Mount a tmpfs of ``size`` at ``path`` (a stand-in for a small /dev/shm); None if refused."""
    import subprocess

    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
    )
    return None if done.returncode != 0 else path


def assert_usable_like_torch_load(tree: Any) -> None:
    """Restored tensors own their storage (offset 0), as torch.load's do; RNG state applies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            assert node.storage_offset() == 0
            assert node.untyped_storage().nbytes() == node.numel() * node.element_size()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    torch.set_rng_state(tree["rng"]["torch"])
