"""A model's repeated blocks: the units activation checkpointing wraps and FSDP2 shards.

A block is a child of an `nn.Sequential` or `nn.ModuleList` whose class repeats there (transformer
layers, ResNet stages), has parameters, and is not a plain layer. Both the checkpointing relief
(`autotune.relief.checkpointing`) and `shard=True` (`autotune.ranks.sharded`) cut the model there.

Owns the rule. Touches nothing.
"""

from __future__ import annotations

from torch import nn

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the blocks worth checkpointing one by one, outermost first."""
    found: list[tuple[str, nn.Module]] = []
    taken: set[int] = set()
    for name, container in model.named_modules():
        if not isinstance(container, (nn.Sequential, nn.ModuleList)) or id(container) in taken:
            continue
        children = list(container.named_children())
        classes: dict[type, int] = {}
        for _, child in children:
            classes[type(child)] = classes.get(type(child), 0) + 1
        for child_name, child in children:
            if classes[type(child)] >= 2 and not isinstance(child, _LAYERS) \
                    and any(True for _ in child.parameters()) and not any(id(m) in taken for m in child.modules()):
                found.append((f"{name}.{child_name}" if name else child_name, child))
                taken.update(id(m) for m in child.modules())
    return found
