"""Structured pruning that really frees memory: whole channels removed with Torch-Pruning, the
optimizer rebuilt around the smaller parameters with its state carried over.

Why not `torch.nn.utils.prune`: it keeps `weight_orig` and a mask and recomputes the weight
every forward, so a step needs *more* memory after it. Removing channels shrinks the
parameters, their gradients, the optimizer state and the activations.

Torch-Pruning replaces each pruned parameter with a new, smaller one. Every replacement goes
through one function (`BasePruningFunc._prune_parameter_and_grad`), which this module watches
while it prunes, to learn for each new parameter which old one it came from and which
indices it kept along which dimension; the optimizer state (momentum, Adam moments) is cut
the same way, so the kept channels continue exactly where they were.

Owns: the pruning and its replay. Touches: the model's parameters (replaced by smaller ones), the
optimizer (rebuilt, its state carried over), the scheduler (rebound).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from autotune.batching import map_tensors, tensor_bytes  # noqa: F401 (tensor_bytes: imported from here too)

PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclasses.dataclass
class PruneResult:
    """What one pruning step did."""

    replaced: dict[int, tuple[nn.Parameter, nn.Parameter, list[tuple[int, list[int]]]]]  # id(old) -> (old, new, cuts)
    parameters_before: int
    parameters_after: int
    ignored: list[str]  # the layers kept whole (the outputs keep their shape)
    history: list[list[Any]] = dataclasses.field(default_factory=list)  # Torch-Pruning's, to replay on a fresh model

    @property
    def removed_fraction(self) -> float:
        return 1 - self.parameters_after / self.parameters_before if self.parameters_before else 0.0


@contextlib.contextmanager
def _watch_replacements() -> Iterator[dict[int, tuple[nn.Parameter, nn.Parameter, list[tuple[int, list[int]]]]]]:
    """Record, for every parameter Torch-Pruning replaces, (original, newest, [(dim, kept indices), ...])."""
    from torch_pruning.pruner.function import BasePruningFunc

    replaced: dict[int, tuple[nn.Parameter, nn.Parameter, list[tuple[int, list[int]]]]] = {}
    by_new: dict[int, int] = {}  # id(newest) -> id(original): a parameter cut twice (out, then in)
    original_fn = BasePruningFunc._prune_parameter_and_grad

    def recording(self: Any, weight: nn.Parameter, keep_idxs: Sequence[int], pruning_dim: int) -> nn.Parameter:
        new = original_fn(self, weight, keep_idxs, pruning_dim)
        root = by_new.pop(id(weight), id(weight))
        old, _, cuts = replaced.get(root, (weight, None, []))
        replaced[root] = (old, new, cuts + [(pruning_dim, list(keep_idxs))])
        by_new[id(new)] = root
        return new

    BasePruningFunc._prune_parameter_and_grad = recording
    try:
        yield replaced
    finally:
        BasePruningFunc._prune_parameter_and_grad = original_fn


def output_layers(model: nn.Module, example: Any, forward_fn: Callable[[nn.Module, Any], Any]) -> list[nn.Module]:
    """The layers whose channels the outputs are made of: the last Linear/Conv the forward
    runs, and any whose output is returned as it is. Pruning them would change the outputs' shape."""
    order: list[nn.Module] = []
    outputs: dict[int, nn.Module] = {}

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        order.append(module)
        if isinstance(output, torch.Tensor):
            outputs[id(output)] = module

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, PRUNABLE)]
    try:
        with torch.no_grad():
            result = forward_fn(model, example)
    finally:
        for handle in handles:
            handle.remove()
    found = [order[-1]] if order else []
    results = result if isinstance(result, (tuple, list)) else [result]
    for tensor in results:
        module = outputs.get(id(tensor))
        if module is not None and module not in found:
            found.append(module)
    return found


def _attention_heads(model: nn.Module) -> dict[nn.Module, int]:
    # Attention splits its width into heads: Torch-Pruning must cut every head alike.
    return {m: m.num_heads for m in model.modules() if isinstance(m, nn.MultiheadAttention)}


class UnsafePruning(Exception):
    """Pruning would break the model (e.g. a residual stream that starts at the raw input); nothing was pruned."""


def _meta_copy(module: nn.Module) -> nn.Module:
    """The module's structure with every parameter and buffer on the meta device: no memory."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _check_on_meta(model: nn.Module, example: Any, ratio: float, forward_fn: Callable[[nn.Module, Any], Any],
                   ignored: list[nn.Module]) -> None:
    """Prune a memory-free copy the same way (which channels does not matter for the shapes)
    and run it: raise UnsafePruning if the pruned model would not run or its outputs change shape."""
    import torch_pruning as tp

    index = {id(m): i for i, m in enumerate(model.modules())}
    copy_ = _meta_copy(model)
    copies = list(copy_.modules())
    meta_example = map_tensors(lambda t: torch.empty_like(t, device="meta"), example)
    try:
        with torch.no_grad():
            before = forward_fn(copy_, meta_example)
        pruner = tp.pruner.MagnitudePruner(  # traces through autograd: not under no_grad
            copy_, meta_example, importance=tp.importance.RandomImportance(), pruning_ratio=ratio,
            ignored_layers=[copies[index[id(m)]] for m in ignored], forward_fn=forward_fn,
            num_heads=_attention_heads(copy_))
        with torch.no_grad():
            pruner.step()
            after = forward_fn(copy_, meta_example)
    except Exception as exc:  # any failure means: do not touch the real model
        raise UnsafePruning(f"a pruned copy of the model does not run: {type(exc).__name__}: {exc}"[:400]) from None
    shapes = [tuple(t.shape) for t in (before if isinstance(before, (tuple, list)) else [before])]
    new_shapes = [tuple(t.shape) for t in (after if isinstance(after, (tuple, list)) else [after])]
    if shapes != new_shapes:
        raise UnsafePruning(f"pruning would change the output shape {shapes} -> {new_shapes}")


def prune_channels(model: nn.Module, example: Any, ratio: float, *,
                   forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                   keep: Sequence[nn.Module] = ()) -> PruneResult:
    """Remove `ratio` of the channels of every prunable layer (by L2 magnitude), except the
    output layers and `keep`. `example` is a small real input; `forward_fn(model, example)`
    runs the model on it (default: `model(example)`). The same pruning is first tried on a
    memory-free (meta) copy: if that copy would not run or its outputs would change shape,
    `UnsafePruning` is raised and the model is left as it was."""
    import torch_pruning as tp

    if not 0 < ratio < 1:
        raise ValueError(f"pruning ratio must be in (0, 1), got {ratio!r}")
    forward_fn = forward_fn or (lambda m, x: m(x))
    ignored = list(dict.fromkeys([*output_layers(model, example, forward_fn), *keep]))
    names = {module: name for name, module in model.named_modules()}
    before = sum(p.numel() for p in model.parameters())
    was_training = model.training
    model.eval()  # tracing runs a forward: BatchNorm statistics must not move
    try:
        _check_on_meta(model, example, ratio, forward_fn, ignored)
        pruner = tp.pruner.MagnitudePruner(
            model, example, importance=tp.importance.MagnitudeImportance(p=2), pruning_ratio=ratio,
            ignored_layers=ignored, forward_fn=forward_fn, num_heads=_attention_heads(model),
        )
        with _watch_replacements() as replaced, torch.no_grad():
            pruner.step()
        history = [[name, bool(out), [int(i) for i in idxs]] for name, out, idxs in pruner.DG.pruning_history()]
    finally:
        model.train(was_training)
    after = sum(p.numel() for p in model.parameters())
    return PruneResult(replaced=replaced, parameters_before=before, parameters_after=after,
                       ignored=[names.get(m, type(m).__name__) for m in ignored], history=history)


def replay_pruning(model: nn.Module, example: Any, history: list[list[Any]], *,
                   forward_fn: Callable[[nn.Module, Any], Any] | None = None) -> PruneResult:
    """Prune a fresh copy of the model exactly as `history` (from `PruneResult.history`) says:
    for resuming a pruned run from its checkpoint into the original, unpruned model."""
    import torch_pruning as tp

    before = sum(p.numel() for p in model.parameters())
    was_training = model.training
    model.eval()
    try:
        graph = tp.DependencyGraph().build_dependency(model, example, forward_fn=forward_fn)
        with _watch_replacements() as replaced, torch.no_grad():
            graph.load_pruning_history(history)
    finally:
        model.train(was_training)
    return PruneResult(replaced=replaced, parameters_before=before,
                       parameters_after=sum(p.numel() for p in model.parameters()), ignored=[], history=history)


def _cut(tensor: torch.Tensor, cuts: list[tuple[int, list[int]]]) -> torch.Tensor:
    for dim, keep in cuts:
        tensor = torch.index_select(tensor, dim, torch.tensor(keep, device=tensor.device))
    return tensor.contiguous()


def rebuild_optimizer(optimizer: torch.optim.Optimizer, result: PruneResult) -> torch.optim.Optimizer:
    """A new optimizer of the same class and settings over the pruned parameters, each
    parameter's state (momentum, Adam moments, step) cut to the kept channels."""
    new_of = {key: new for key, (_, new, _) in result.replaced.items()}
    cuts_of = {key: cuts for key, (_, _, cuts) in result.replaced.items()}
    groups = []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": [new_of.get(id(p), p) for p in group["params"]]})
    # Only the settings its constructor takes (defaults also hold derived keys); each group
    # carries all of its own settings anyway.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    rebuilt = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    rebuilt.defaults = dict(optimizer.defaults)
    for group, new_group in zip(optimizer.param_groups, rebuilt.param_groups):
        for old, new in zip(group["params"], new_group["params"]):
            state = optimizer.state.get(old)
            if not state:
                continue
            cuts = cuts_of.get(id(old), [])
            rebuilt.state[new] = {
                key: _cut(value, cuts) if isinstance(value, torch.Tensor) and value.shape == old.shape and cuts
                else value
                for key, value in state.items()
            }
    return rebuilt


def adopt_unrecorded(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """Safety net: parameters of `model` the optimizer does not hold (replaced some other way
    than the recorded one) join its first group with fresh state; ones the model no longer has
    leave it. Returns how many were adopted."""
    live = {id(p) for p in model.parameters()}
    held = set()
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in live]
        held.update(id(p) for p in group["params"])
    missing = [p for p in model.parameters() if id(p) not in held]
    optimizer.param_groups[0]["params"].extend(missing)
    return len(missing)


def rebind_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point an LR scheduler (and those it chains) at the rebuilt optimizer; the param groups
    keep their order, so its per-group state still lines up."""
    if scheduler is None:
        return
    if hasattr(scheduler, "optimizer"):
        scheduler.optimizer = optimizer
    for inner in getattr(scheduler, "_schedulers", []):  # SequentialLR, ChainedScheduler
        rebind_scheduler(inner, optimizer)
