"""Activation checkpointing as a memory relief: keep only each block's input, recompute the
inside during backward (about one more forward of compute for much less activation memory).

Which blocks: the model's repeated blocks, i.e. sibling modules of one class (two or more)
inside an `nn.Sequential` or `nn.ModuleList` that hold parameters and are not single layers:
ResNet's BasicBlocks, transformer layers. A model that is one flat `nn.Sequential` of layers
is checkpointed in about sqrt(n) segments instead. Recomputation replays the random state
(dropout masks match); BatchNorm running statistics see the recomputed forward too.

Owns: the wrapping of the chosen blocks' forward. Touches those blocks' forward only.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from autotune.common.model_blocks import repeated_blocks

_MARK = "_autotune_checkpointed"


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _sequential_forward(module: nn.Sequential, segments: int, x: Any) -> Any:
    return checkpoint_sequential(module, segments, x, use_reentrant=False)


def checkpoint_blocks(model: nn.Module) -> list[str]:
    """Checkpoint the model's repeated blocks (or a flat Sequential in segments); returns what
    was wrapped. Idempotent: a second call wraps nothing and returns []."""
    if getattr(model, _MARK, False):
        return []
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # A Hugging Face model that caches keys and values would append them again in each
        # block's recomputation (the attention then sees twice the keys): HF turns the cache
        # off when it checkpoints, and so does this.
        config.use_cache = False
    wrapped = []
    for name, block in repeated_blocks(model):
        if getattr(block, _MARK, False):
            continue
        block.forward = functools.partial(_checkpointed_forward, block.forward)  # the instance's, not the class's
        setattr(block, _MARK, True)
        wrapped.append(name)
    if not wrapped and isinstance(model, nn.Sequential) and len(model) >= 4:
        segments = max(2, round(math.sqrt(len(model))))
        model.forward = functools.partial(_sequential_forward, model, segments)
        wrapped.append(f"the model's {len(model)} layers in {segments} segments")
    setattr(model, _MARK, True)
    return wrapped
