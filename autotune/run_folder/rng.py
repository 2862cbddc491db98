"""The random states a checkpoint keeps and a resume restores: Python's, numpy's, torch's and CUDA's,
as plain data and tensors (a checkpoint loads with weights_only=True).

Owns: the capture and the restore. Touches the process's random generators.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch and CUDA random states as plain data and tensors."""
    version, keys, gauss = random.getstate()
    kind, np_keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(keys), gauss],
        "numpy": [kind, torch.from_numpy(np_keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
