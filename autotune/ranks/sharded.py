"""FSDP2 (`fully_shard`) under torchrun: an OOM on any rank, and no rank left in a collective.

DDP exchanges gradients once, after the ranks agree (distributed.py). FSDP2 exchanges inside
every forward and backward: an all-gather of a block's parameters before the block runs
(forward, and again in backward), a reduce-scatter of its gradients after its backward. A rank
that runs out of memory in between leaves the others waiting in the next exchange. So every
FSDP2 exchange is preceded here by a *check*: a one-number all-reduce on a side gloo group
that says whether any rank has failed. On the host: a CUDA OOM is raised on the host when an
allocation fails, so the check needs no device synchronisation.

    every rank, one attempt at a batch:
      before each FSDP2 all-gather / reduce-scatter:  check(0); a 1 back -> raise PeerFailed
      the attempt done:                               check(0); a 1 back -> the attempt failed elsewhere
    a rank whose attempt ran out of memory:           check(1), once, outside its `except`

The check sits inside FSDP2's communication hook (`set_custom_all_gather` /
`set_custom_reduce_scatter`), after FSDP2 allocated the exchange's buffers: an OOM while
allocating them is caught like any other. On CPU, gloo's exchanges allocate temporaries of
their own (copies of both sides of the exchange: the all-gather's input and flat output, the
reduce-scatter's input and output): an OOM there, after the check, would leave the others
inside the exchange. So before the check the hook reserves that much memory and frees it just
before the exchange, which then finds the room it needs: the failure, if any, comes before the
check, where it is agreed on. Every rank makes the same checks in the same
order until one fails; the failing rank's check(1) meets the others' next check, whichever it
is, so each rank makes exactly as many checks as the others, and the agreement that follows
(distributed.py's `Agreement`) pairs up as it does under DDP.

After a failed attempt every rank resets FSDP2's state: `reset_iter_state()` on the root
(in-flight exchanges waited for, parameters resharded, iteration trackers cleared), and the
unsharded gradients it leaves behind dropped (those of a backward cut short, and those a
`no_sync` accumulation held). Micro-batches accumulate through FSDP2's own no-sync path:
gradients are reduce-scattered in the last micro-batch's backward only.

As a last line, the checks' group and FSDP2's own groups carry a timeout (`timeout_s`, default
300 s or `AUTOTUNE_EXCHANGE_TIMEOUT_S`; gloo's own is 30 minutes): a rank that fails inside an
exchange anyway (a custom comm's allocation, a lost peer) ends the job with an error naming the
exchange and the step on every rank (`ExchangeFailed`), instead of a hang.

FSDP2's parameter groups and their unsharded gradients are private in torch 2.14; this file
is the only one that reads them (`_param_groups`, `_drop_unsharded_gradients`).

Owns: the FSDP2 checks, resets and sharded state. Touches: the model's FSDP2 state (sync flags,
iteration state, unsharded gradients).
"""

from __future__ import annotations

import datetime
import mmap
import os
import resource
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from autotune.common.model_blocks import repeated_blocks
from autotune.common.oom import ExchangeFailed, UnsafePruning, is_oom
from autotune.ranks.job import CheckpointWriter, Held, T

DEFAULT_TIMEOUT_S = 300.0  # far below gloo's 30 minutes; above any wait a healthy job makes between exchanges


class PeerFailed(RuntimeError):
    """Raised out of forward or backward on a rank whose peer ran out of memory in this attempt."""


def exchange_timeout_s() -> float:
    """The checks' and FSDP2's exchanges' timeout: AUTOTUNE_EXCHANGE_TIMEOUT_S, else 300 s."""
    value = os.environ.get("AUTOTUNE_EXCHANGE_TIMEOUT_S")
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"AUTOTUNE_EXCHANGE_TIMEOUT_S must be a number of seconds above 0, not {value!r}")
    return seconds


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that `fully_shard` was applied to (the root first, if it is one)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is (or holds) a module sharded with FSDP2's `fully_shard`."""
    return bool(fsdp_modules(model))


def shard(model: nn.Module) -> list[str]:
    """`fully_shard` the model's repeated blocks (the ones the checkpointing relief finds: transformer
    layers, ResNet blocks), then the root. Returns the blocks' names."""
    from torch.distributed.fsdp import fully_shard

    blocks = repeated_blocks(model)
    for _, block in blocks:
        fully_shard(block)
    fully_shard(model)
    return [name for name, _ in blocks]


class Sharded:
    """A sharded (FSDP2) model's strategy under torchrun: the checks around its exchanges, the
    no-sync switch, the reset after a failure, its state in shards (see the module docstring).
    It answers job.py's Protocol as whole_model.py's `Replicated` does for a DDP model (and
    `Single` alone), so the loop never asks which it runs under. Every rank must run as many
    forwards (they all-gather); gradients are reduce-scattered inside the last backward (no
    all-reduce of autotune's, so the ranks' news has none to ride in); a checkpoint is a folder
    every rank writes its shards to."""

    def __init__(self, model: nn.Module, timeout_s: float | None = None):
        root = fsdp_modules(model)
        if not root or root[0] is not model:
            raise ValueError("a sharded model must be fully_shard-ed at its root too (fully_shard(model) after its "
                             "blocks): autotune resets FSDP2's state through the root after an OOM")
        meshes = {p.device_mesh.ndim for p in model.parameters() if hasattr(p, "device_mesh")}  # DTensors
        if any(ndim > 1 for ndim in meshes):
            raise ValueError("the model is sharded over a 2-D device mesh (HSDP, or FSDP with tensor parallelism): "
                             "autotune checks FSDP2's all-gathers and reduce-scatters only, not the all-reduce across "
                             "replicas or the tensor-parallel exchanges, so an OOM on one rank could leave others "
                             "waiting in those; shard over a 1-D mesh (fully_shard's default)")
        if not hasattr(model, "reset_iter_state"):
            raise RuntimeError(f"torch {torch.__version__}'s FSDP2 cannot reset its state after an exception "
                               "(FSDPModule.reset_iter_state, in torch 2.14): autotune cannot train a sharded model on it")
        self.model, self.modules = model, root
        self.rank = dist.get_rank()
        self.timeout_s = exchange_timeout_s() if timeout_s is None else float(timeout_s)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # Checks on a gloo group of their own: host memory, never in the way of the device's
        # streams, and never interleaved with FSDP2's own (possibly asynchronous) exchanges.
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        # FSDP2's exchanges run on the mesh's group (often the default one): a rank left inside
        # one by a peer that failed there waits this long, not gloo's 30 minutes.
        for group in {p.device_mesh.get_group() for p in model.parameters() if hasattr(p, "device_mesh")}:
            dist.set_timeout(timeout, group)
        self.flag = torch.zeros(1, dtype=torch.int64)
        self.checks = 0  # made in this process (a test reads it: every rank makes as many)
        self.step = 0  # the optimizer step being attempted, for the errors' wording
        self.broken: str | None = None  # the exchange this rank failed inside, if it did
        self._syncing = True  # what set_requires_gradient_sync was last told
        names = {module: name for name, module in model.named_modules()}
        for module in self.modules:
            _check_exchanges(module, repr(names[module]) if names[module] else "the root", self)

    def check(self, failed: bool = False) -> bool:
        """Join the other ranks' check (each rank makes it at the same point): whether any rank failed."""
        if self.broken is not None:
            # The others are inside the exchange this rank failed in: they cannot come to a check.
            raise ExchangeFailed(f"rank {self.rank} failed inside FSDP2's {self.broken} at step {self.step + 1}, after "
                                 "the check before it had passed: the other ranks are waiting inside that exchange and "
                                 "cannot be told, so the job stops here (the last checkpoint is where to resume)")
        self.checks += 1
        self.flag.fill_(int(failed))
        try:
            dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as exc:  # a peer gone, or no peer within the timeout
            raise ExchangeFailed(f"rank {self.rank}: autotune's check at step {self.step + 1} found no other rank within "
                                 f"{self.timeout_s:g} s (AUTOTUNE_EXCHANGE_TIMEOUT_S): another rank failed inside an "
                                 f"exchange or stopped ({_first_line(exc)})") from None
        return bool(self.flag.item())

    def exchange(self, kind: str, name: str, reserve_bytes: int, run: Callable[[], Any]) -> Any:
        """One FSDP2 exchange, `run()`, after its check (module docstring). `reserve_bytes`: what the
        exchange will allocate of its own, held through the check and freed just before it."""
        # An OOM here (the reservation) comes before the check: the ranks still pair.
        held = _reserve_address_space(reserve_bytes)
        if self.check(False):
            raise PeerFailed("another rank ran out of memory in this attempt")
        if held is not None:
            held.close()  # unmapped: the exchange's own allocations find the room, heap or mapping
        try:
            return run()
        except Exception as exc:
            where = f"{kind} of {name}"
            self.broken = where  # this rank's next check says so instead of waiting for ever
            if is_oom(exc):
                raise ExchangeFailed(f"rank {self.rank} ran out of memory inside FSDP2's {where} at step "
                                     f"{self.step + 1}, after the check before it had passed: the other ranks are "
                                     f"inside that exchange and cannot be told, so the job stops here "
                                     f"({_first_line(exc)})") from None
            if isinstance(exc, RuntimeError):  # gloo: a peer gone, or none within the timeout
                raise ExchangeFailed(f"rank {self.rank}: FSDP2's {where} at step {self.step + 1} failed after every "
                                     f"rank's check had passed: another rank failed inside it or stopped (timeout "
                                     f"{self.timeout_s:g} s, AUTOTUNE_EXCHANGE_TIMEOUT_S): {_first_line(exc)}") from None
            raise

    def same_size(self, micro_batch_size: int, n: int, step: int | None = None) -> int:
        """Rank 0's micro-batch, before an attempt: every rank must run as many micro-batches (as many
        exchanges). Under DDP a rank may differ until the agreement; here a policy that moved one
        rank's size after the last agreement would leave the ranks in different exchanges. A batch
        of another length on some rank would too: that is an error, on every rank."""
        if step is not None:
            self.step = step
        values = torch.tensor([micro_batch_size if self.rank == 0 else 0, n, -n], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        size, longest, shortest = int(values[0]), int(values[1]), -int(values[2])
        if longest != shortest:
            raise ValueError(f"under FSDP2 every rank's batch must hold as many samples; this step's hold {shortest} "
                             f"to {longest}: use a sampler that pads every rank's share to the same length (AutoTrainer's "
                             "own does, as DistributedSampler does) or drop_last=True")
        return size

    def micro_batch(self, last: bool) -> None:
        """Before a micro-batch's backward: reduce-scatter gradients only in the batch's last one."""
        if last != self._syncing:
            self.model.set_requires_gradient_sync(last)
            self._syncing = last

    def end_attempt(self, failed: bool, peer_failed: bool) -> bool:
        """After an attempt (outside its `except`): the last check of it. Returns whether another
        rank failed after this one's attempt was done (then this attempt counts as failed too)."""
        if peer_failed:
            return True  # the check that told it was this attempt's last
        return self.check(failed) and not failed

    def reset_after_failure(self) -> None:
        """After a failed attempt, on every rank: FSDP2's state as before the attempt, no gradients held."""
        self.model.reset_iter_state()
        _drop_unsharded_gradients(self.modules)
        self.micro_batch(True)

    def items_reference(self, estimate: Any) -> Any:
        """1: FSDP2 sums the ranks' gradients in backward, before any rank knows the others' items:
        each rank weights by raw items, divided after (`divide_by_items`)."""
        return 1

    def gradients_untouched(self) -> bool:
        return False  # FSDP2's gradients are its own tensors: the caller's are held back

    def held_into_buffers(self, held: Held) -> Held:
        return held  # no buffer of autotune's: added after the division, as alone

    def average_gradients(self, world: int) -> None:
        pass  # FSDP2 averaged them in the last backward's reduce-scatter

    def reduce_with_news(self, news: bool, ref: Any, items: Any, world: int) -> bool | None:
        return None  # reduced inside backward already: the ranks agree in full

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def check_finite_late(self, try_late: Callable[[], bool]) -> bool:
        return False  # every rank's shards are checked together (`finite_everywhere`): at once

    def evaluate(self, batches: Iterable[Any], each: Callable[[Any], int],
                 in_rounds: Callable[[Iterable[Any]], int]) -> int:
        return in_rounds(batches)  # every forward all-gathers: every rank runs as many

    def require_free_forwards(self, what: str, instead: str) -> None:
        raise NotImplementedError(f"{what} under FSDP2 (every forward is collective) is not supported yet: {instead}")

    def check_prunable(self) -> None:
        raise UnsafePruning("the model is sharded with FSDP2: its parameters are shards that pruning cannot trace or "
                            "cut (the cheaper reliefs, autocast and checkpointing, still apply)")

    def reads_shards(self, template: T | None) -> T | None:
        return template  # its own shards, as they are

    def prepare_checkpoint(self, writer: CheckpointWriter, step: int, is_main: bool) -> None:
        if is_main:  # before the gather: no rank writes there yet
            writer.clear_unfinished(step)

    def write_checkpoint(self, writer: CheckpointWriter, state: dict[str, Any], step: int, is_main: bool) -> Any:
        return writer.write_shards(state, step, is_main)  # every rank its own, at once

    def finite_everywhere(self, finite: bool, device: torch.device) -> bool:
        """Whether every rank's gradient shards are finite (each rank holds its own)."""
        flag = torch.tensor([int(not finite)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not bool(flag.item())

    def divide_by_items(self, grads: list[torch.Tensor], ref: Any, items: Any) -> None:
        """Every rank weighted its micro-batches by raw items (ref 1: see StepCore.attempt) and FSDP2
        averaged the gradients over ranks: times world over every rank's items."""
        total = torch.as_tensor(items, dtype=torch.float64).reshape(1).to(grads[0].device if grads else "cpu")
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        torch._foreach_mul_(grads, dist.get_world_size() / max(float(total), 1.0))

    @staticmethod
    def model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
        """This rank's shards (sharded_checkpoint.py writes them)."""
        return sharded_state(model, optimizer)

    @staticmethod
    def load_model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any],
                         optimizer_state: Any) -> None:
        load_sharded_state(model, optimizer, weights, optimizer_state)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _reserve_address_space(nbytes: int) -> mmap.mmap | None:
    """`nbytes` of address space mapped (never touched) where RLIMIT_AS caps it, else None: the
    cap counts mappings, so the mapping fails (MemoryError, an OOM) where the exchange's own
    allocations would. A mapping, not a tensor: a freed tensor may stay in glibc's heap, where
    the exchange's allocation, served elsewhere, would not find it."""
    if not nbytes or resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        return None  # nothing caps the address space: no allocation of its can fail short of the machine's
    try:
        return mmap.mmap(-1, nbytes)
    except OSError as exc:
        raise MemoryError(f"cannot map {nbytes} bytes for an FSDP2 exchange's own buffers under RLIMIT_AS "
                          f"({exc.strerror})") from None


def _own_temporaries(output: torch.Tensor, input: torch.Tensor) -> int:
    # gloo (CPU tensors) copies both sides of an exchange into buffers of its own (the
    # all-gather's input and flat output; the reduce-scatter's input, cloned, and its output):
    # as much as both, and a little more for its bookkeeping. NCCL allocates nothing through
    # torch's allocator.
    if output.device.type != "cpu":
        return 0
    size = output.numel() * output.element_size() + input.numel() * input.element_size()
    return size + size // 8 + 2**20


def _check_exchanges(module: nn.Module, name: str, steps: Sharded) -> None:
    """Put a check before every all-gather and reduce-scatter FSDP2 makes for `module`."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class CheckedAllGather(AllGather):
        def __init__(self, inner: Any):
            self.inner = inner

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            # On CPU an asynchronous all-gather (FSDP2's prefetch) would allocate in gloo's thread
            # while this one goes on allocating: the room reserved for it could be taken. It runs
            # here, at once, and FSDP2 is given no work to wait for (None: done).
            on_cpu = output_tensor.device.type == "cpu"
            work = steps.exchange("all-gather", name, _own_temporaries(output_tensor, input_tensor),
                                  lambda: self.inner(output_tensor, input_tensor, group, async_op and not on_cpu))
            return None if on_cpu else work

    class CheckedReduceScatter(ReduceScatter):
        def __init__(self, inner: Any):
            self.inner = inner

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            on_cpu = output_tensor.device.type == "cpu"  # as for the all-gather
            work = steps.exchange("reduce-scatter", name, _own_temporaries(output_tensor, input_tensor),
                                  lambda: self.inner(output_tensor, input_tensor, group, op, async_op and not on_cpu))
            return None if on_cpu else work

    groups = _param_groups(module)
    if not groups:
        return  # a module with no parameters of its own: FSDP2 exchanges nothing for it
    if len(groups) > 1:
        raise ValueError(f"{type(module).__name__} is sharded in {len(groups)} parameter groups "
                         "(shard_placement_fn): autotune can check the exchanges of one group per module only")
    # Wrapping the comm in place keeps a custom one the user set (FSDP2's default otherwise).
    module.set_custom_all_gather(CheckedAllGather(groups[0]._all_gather_comm))
    module.set_custom_reduce_scatter(CheckedReduceScatter(groups[0]._reduce_scatter_comm))


def _param_groups(module: nn.Module) -> list[Any]:
    # torch 2.14 private: the FSDP2 state's parameter groups (each with its comms and FSDPParams).
    return list(module._get_fsdp_state()._fsdp_param_groups)


def _drop_unsharded_gradients(modules: list[nn.Module]) -> None:
    # reset_iter_state() reshards the parameters but leaves the gradients autograd wrote onto
    # the unsharded ones (a group whose post-backward never ran: the root's, in a backward cut
    # short) and no_sync's accumulated ones: the retry would add them in. torch 2.14 private.
    for module in modules:
        for group in _param_groups(module):
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
    """The whole model's weights and optimizer state as full tensors on the host, gathered from
    every rank's shards (every rank calls it; rank 0 gets them, the others empty dicts): to
    export a trained model. Checkpoints stay sharded (`sharded_state`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    return weights, get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
    """This rank's shards of the weights and of the optimizer state (DTensors, by parameter name):
    what `torch.distributed.checkpoint` saves. Nothing is gathered or copied."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model)
    return weights, get_optimizer_state_dict(model, optimizer) if optimizer is not None else None


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, Any],
                       optimizer_state: Any) -> None:
    """Put what `sharded_state` returned (read back from a checkpoint) into the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    if not any(isinstance(value, DTensor) for value in weights.values()):
        # Whole tensors: the checkpoint of a job of one process (a sharded job grown from one: issue 33).
        # Every rank read the file; each keeps its shards of every tensor.
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        whole = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, weights, options=whole)
        if optimizer is not None and optimizer_state is not None:
            set_optimizer_state_dict(model, optimizer, _keyed_by_name(model, optimizer, optimizer_state),
                                     options=whole)
        return
    set_model_state_dict(model, weights)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state)


def _keyed_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """`optimizer.state_dict()` of a job of one process (its parameters numbered in the optimizer's
    order) keyed by parameter name, as torch's distributed state-dict functions take it. The numbers
    are this optimizer's order: one made alike over the same model's parameters."""
    if all(isinstance(key, str) for key in state["state"]):
        return state
    names = {param: name for name, param in model.named_parameters()}
    by_number = [names[param] for group in optimizer.param_groups for param in group["params"]]
    return {"state": {by_number[number]: values for number, values in state["state"].items()},
            "param_groups": [{**group, "params": [by_number[number] for number in group["params"]]}
                             for group in state["param_groups"]]}
