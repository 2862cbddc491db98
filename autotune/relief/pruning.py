"""Structured pruning that really frees memory: whole channels removed with Torch-Pruning, the
same optimizer object remapped onto the smaller parameters with its state carried over.

Why not `torch.nn.utils.prune`: it keeps `weight_orig` and a mask and recomputes the weight
every forward, so a step needs *more* memory after it. Removing channels shrinks the
parameters, their gradients, the optimizer state and the activations.

Torch-Pruning replaces each pruned parameter with a new, smaller one. Every replacement goes
through one function (`BasePruningFunc._prune_parameter_and_grad`), which this module watches
while it prunes, to learn for each new parameter which old one it came from and which
indices it kept along which dimension; the optimizer state (momentum, Adam moments) is cut
the same way, so the kept channels continue exactly where they were.

The optimizer is never replaced: its groups' `params` lists and its `state` are remapped in
place, so an LR scheduler, a GradScaler or a script that holds it goes on steering the
parameters that train.

Owns: the pruning and its replay. Touches: the model's parameters (replaced by smaller ones), the
optimizer's param groups and state (remapped in place).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from autotune.common.batching import map_tensors, tensor_bytes  # noqa: F401 (tensor_bytes: imported from here too)
from autotune.common.oom import UnsafePruning  # raised here, and by a job whose model cannot be pruned (ranks/)

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


_UNCUTTABLE = object()  # a state tensor whose dimensions do not follow the parameter's


def _cut_state(value: Any, shape: torch.Size, cuts: list[tuple[int, list[int]]]) -> Any:
    """One state entry cut as its parameter was: a tensor shaped like the parameter (momentum, Adam's
    moments), or like it with some dimensions reduced to 1 (Adafactor's row and column factors), along
    each cut dimension it has in full; a scalar (step) or a non-tensor as it is; anything else
    `_UNCUTTABLE`."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.dim() != len(shape) or any(n not in (size, 1) for n, size in zip(value.shape, shape)):
        return _UNCUTTABLE
    sizes = list(shape)  # the parameter's, as each cut leaves it
    for dim, keep in cuts:
        if value.shape[dim] == sizes[dim]:  # a dimension reduced to 1 stays as it is
            value = torch.index_select(value, dim, torch.tensor(keep, device=value.device))
        sizes[dim] = len(keep)
    return value.contiguous()


@dataclasses.dataclass
class OptimizerRemap:
    """What pruning makes of an optimizer, computed and not yet put in: each group's parameters
    (the pruned ones in the place of those they replace, same order) and their state cut to the
    kept channels. `apply` puts it into the same optimizer object, allocating nothing, so a failure
    before it leaves the optimizer as it was and nothing after it can fail half-way."""

    optimizer: torch.optim.Optimizer
    params: list[list[nn.Parameter]]  # per group
    state: dict[nn.Parameter, dict[str, Any]]  # new parameter -> its cut state
    replaced: list[nn.Parameter]  # the old parameters whose state goes
    fresh: list[str]  # "shape: key" of each parameter whose state could not be cut (it starts fresh)

    def apply(self) -> None:
        """Remap in place: the groups' own `params` lists and the optimizer's own `state`, so that
        whatever holds the optimizer (an LR scheduler, a GradScaler, the user's script) or a group
        (LBFGS keeps its group's list) sees the pruned parameters."""
        for group, params in zip(self.optimizer.param_groups, self.params):
            group["params"][:] = params
        state = self.optimizer.state
        for old in self.replaced:
            state.pop(old, None)  # the old channels' state: the memory pruning frees
        state.update(self.state)


def remap_optimizer(optimizer: torch.optim.Optimizer, result: PruneResult) -> OptimizerRemap:
    """The same optimizer over the pruned parameters (see `OptimizerRemap`), each replaced
    parameter's state (momentum, Adam moments, step) cut to the kept channels. Allocates the cut
    state (it may run out of memory); touches nothing until `apply`."""
    new_of = {key: new for key, (_, new, _) in result.replaced.items()}
    cuts_of = {key: cuts for key, (_, _, cuts) in result.replaced.items()}
    params = [[new_of.get(id(p), p) for p in group["params"]] for group in optimizer.param_groups]
    state: dict[nn.Parameter, dict[str, Any]] = {}
    replaced: list[nn.Parameter] = []
    fresh: list[str] = []
    for group in optimizer.param_groups:
        for old in group["params"]:
            if id(old) not in new_of:
                continue
            replaced.append(old)
            entries = optimizer.state.get(old)
            if not entries:
                continue
            cut = {key: _cut_state(value, old.shape, cuts_of[id(old)]) for key, value in entries.items()}
            uncuttable = [key for key, value in cut.items() if value is _UNCUTTABLE]
            if uncuttable:  # half a state would be worse than none: the optimizer starts it afresh
                fresh.append(f"{tuple(old.shape)}: {', '.join(uncuttable)}")
            else:
                state[new_of[id(old)]] = cut
    return OptimizerRemap(optimizer, params, state, replaced, fresh)


def adopt_unrecorded(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """Safety net: parameters of `model` the optimizer does not hold (replaced some other way
    than the recorded one) join its first group with fresh state; ones the model no longer has
    leave it. Returns how many were adopted."""
    live = {id(p) for p in model.parameters()}
    held = set()
    for group in optimizer.param_groups:
        for gone in [p for p in group["params"] if id(p) not in live]:
            optimizer.state.pop(gone, None)
        group["params"][:] = [p for p in group["params"] if id(p) in live]
        held.update(id(p) for p in group["params"])
    missing = [p for p in model.parameters() if id(p) not in held]
    optimizer.param_groups[0]["params"].extend(missing)
    return len(missing)
