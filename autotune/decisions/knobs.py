"""The only code that changes what policies control, and the one place conflicts are resolved.

Policies propose; `resolve_conflicts` decides which proposals of one round go ahead, and
`apply` carries an action out on the trainer's `Knobs` and says what happened, so the
journal can record it. The trainer reads the knobs and changes them only through the
methods below (rank 0's size under torchrun, a checkpoint's sizes, taking the pending
relief to carry it out). Add a new action by adding its record to actions.py and one
`@apply.register` function here.

Owns: the knobs, the pending relief, conflict resolution. Touches: the allocator (EmptyCache),
nothing of the model (reliefs are carried out by the Tuner's ladder).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import torch

from autotune.common.actions import (
    Action,
    CacheSamples,
    CheckpointActivations,
    EmptyCache,
    PruneChannels,
    Relief,
    SetLoaderWorkers,
    SetMicroBatch,
    UseAutocast,
    action_kind,
    action_params,
)
from autotune.common.notices import warn
from autotune.common.units import format_bytes
from autotune.memory.figures import device_sample, free_cpu_caches, free_memory


_RUNS = itertools.count()  # each Knobs' own number: what it says once is said again by another run's


@dataclasses.dataclass
class Knobs:
    """The settings of a run that actions may change."""

    batch_size: int  # samples per optimizer step (the loader's batch)
    micro_batch_size: int  # samples per forward/backward
    device: torch.device
    memory_cap_bytes: int | None = None
    sized: bool = True  # the sizes are known (given, or the first batch seen): False until then
    batch_size_fixed: bool = False  # the batch size was given: a larger batch does not raise it
    micro_batch_given: int | None = None  # the user's: growing past it is said once (`_moved_past_given`)
    micro_batch_ceiling: int | None = None  # max_micro_batch_size: the policies never grow the micro-batch past it
    run: int = dataclasses.field(default_factory=lambda: next(_RUNS), repr=False)  # the notice's key: once a run
    num_workers: int = 0  # DataLoader worker processes
    workers_ceiling: int | None = None  # the most that can start here (none where /dev/shm is full); None: no limit
    sample_cache: CacheSamples | None = None  # the cache asked for, once asked
    # Bumped by every change to the two above; the trainer rebuilds its loader at the next
    # batch boundary when it differs from the version its loader was built for.
    loader_version: int = 0
    # The pending relief, in one place on its way from a policy to the model (the Tuner carries it
    # out: it changes the model or the forward). One at a time, so each rung's effect is seen
    # before the next. `relief`: asked by a policy on this rank; `relief_agreed`: rank 0's, which
    # every rank carries out at the next safe point. Every job takes it at the same points
    # (tuner.py): alone there is nothing to agree, and what was asked is carried out. (Who asked
    # is the dispatcher's to remember: dispatch.py.)
    relief: Relief | None = None
    relief_agreed: Relief | None = None

    @property
    def host_cap_bytes(self) -> int | None:
        """The memory cap where it binds host memory (training on CPU), else None: what a
        background checkpoint's copy and the sample cache must fit under beside the host's limits."""
        return self.memory_cap_bytes if self.device.type == "cpu" else None

    def under_ceiling(self, size: int) -> int:
        """`size`, no larger than max_micro_batch_size."""
        return min(size, self.micro_batch_ceiling or size)

    def _moved_past_given(self, old: int, why: str) -> None:
        """The micro-batch moved from `old` to its size now: where that crossed the one the user gave
        (from at or below it to above), said once a run. Growing is the point where memory is left
        unused; doing it silently is not (more memory in use, other numerics with BatchNorm)."""
        given, size = self.micro_batch_given, self.micro_batch_size
        if given is not None and old <= given < size:
            warn(f"micro-batch {old} -> {size}, past the {given} you gave{why}. Pass max_micro_batch_size={given} "
                 "to keep yours", key=f"micro-batch grown, run {self.run}")

    def follow(self, micro_batch_size: int) -> None:
        """Use `micro_batch_size` from now on: rank 0's, agreed by every rank under torchrun."""
        if micro_batch_size != self.micro_batch_size:
            _set_micro_batch(SetMicroBatch(micro_batch_size), self)

    def take_relief(self) -> Relief | None:
        """The relief a policy asked for, now taken to carry out (alone: nothing to agree on)."""
        relief, self.relief = self.relief, None
        return relief

    def take_agreed_relief(self) -> Relief | None:
        """The relief every rank agreed on (rank 0's), now taken to carry out."""
        relief, self.relief_agreed = self.relief_agreed, None
        return relief

    def settle_relief(self, agreed: Relief | None, is_main: bool) -> Relief | None:
        """After an agreement that carried rank 0's relief (`agreed`): it is every rank's to
        carry out. Returns this rank's own asked relief where it goes no further (on a rank
        other than 0, whose policies decide), for the caller to say so."""
        if agreed is not None:
            self.relief_agreed = agreed
        if self.relief is None or (is_main and agreed is None):
            return None  # nothing asked here, or alone (the agreement carries no relief): carried out as asked
        mine, self.relief = self.relief, None
        return None if mine is agreed else mine

    def drop_relief(self) -> Relief | None:
        """The pending relief (asked or agreed), dropped: a smaller micro-batch goes first, since
        reliefs are the last resort. Returns it, for the caller to say so."""
        dropped = self.relief or self.relief_agreed
        self.relief = self.relief_agreed = None
        return dropped

    def restore(self, micro_batch_size: int, num_workers: int | None = None, batch_size: int | None = None) -> bool:
        """The sizes a checkpoint saved (`batch_size`: the largest batch a Tuner had seen, kept
        where larger, unless the batch size was given); True if the loader workers changed (it
        must be rebuilt)."""
        before = self.micro_batch_size
        self.micro_batch_size, self.sized = self.under_ceiling(micro_batch_size), True
        self._moved_past_given(before, " (the checkpoint's, as the run had tuned it)")
        if batch_size and not self.batch_size_fixed:
            self.batch_size = max(self.batch_size, batch_size)
        if num_workers is None or num_workers == self.num_workers:
            return False
        self.num_workers = num_workers
        return True

    @classmethod
    def given(cls, batch_size: int | None, micro_batch_size: int | None, device: torch.device,
              memory_cap_bytes: int | None, ceiling: int | None = None) -> "Knobs":
        """The knobs of a run given these sizes (either, both or none: the first batch sets what is
        missing, `size_for`); a micro-batch alone is the batch too until a larger batch comes.
        `ceiling`: the largest micro-batch the policies may set (max_micro_batch_size)."""
        knobs = cls(batch_size=batch_size or micro_batch_size or 1, micro_batch_size=micro_batch_size or batch_size or 1,
                    device=device, memory_cap_bytes=memory_cap_bytes, batch_size_fixed=batch_size is not None,
                    sized=batch_size is not None or micro_batch_size is not None, micro_batch_given=micro_batch_size,
                    micro_batch_ceiling=ceiling)
        knobs.micro_batch_size = knobs.under_ceiling(knobs.micro_batch_size)
        return knobs

    def size_for(self, n: int) -> None:
        """A batch of `n`: the first one sizes the run (it starts in one piece); one larger than
        any before is the batch the micro-batch may grow up to, unless the batch size was given."""
        if not self.sized:
            self.batch_size = n
            self.micro_batch_size = self.under_ceiling(n)
            self.sized = True
        elif n > self.batch_size and not self.batch_size_fixed:
            self.batch_size = n

    def rebatch(self, batch_size: int) -> None:
        """Each rank's batch on a job of another size (a resume on more or fewer ranks); the
        micro-batch no larger than it."""
        self.batch_size = batch_size
        self.micro_batch_size = min(self.micro_batch_size, batch_size)

    def workers_in_use(self, num_workers: int) -> None:
        """The loader's workers as its host built it (not a change: nothing is rebuilt)."""
        self.num_workers = num_workers

    def workers_cannot_start(self, num_workers: int) -> None:
        """The loader fell back to `num_workers` because more could not start (its host rebuilt it):
        no action raises them again in this run."""
        self.num_workers = self.workers_ceiling = num_workers


def resolve_conflicts(proposals: list[tuple[Any, Action]]) -> list[tuple[Any, Action, str | None]]:
    """Decide which proposals of one round to carry out. Returns (policy, action, why_suppressed or None).

    Two micro-batch sizes in one round: the smaller wins, because the OOM it avoids costs
    more than the throughput it gives up. Identical actions run once. One relief at a time
    (`apply` also refuses a second while one is pending), so each rung's effect is seen first.
    """
    smallest = min((a.size for _, a in proposals if isinstance(a, SetMicroBatch)), default=None)
    resolved: list[tuple[Any, Action, str | None]] = []
    seen: set[tuple[str, tuple]] = set()
    winner_taken = False
    for policy, action in proposals:
        key = (action_kind(action), tuple(sorted(action_params(action).items())))
        if isinstance(action, SetMicroBatch) and (action.size != smallest or winner_taken):
            resolved.append((policy, action, f"another policy asked for micro-batch {smallest}"))
            continue
        if key in seen:
            resolved.append((policy, action, "the same action was already taken this round"))
            continue
        seen.add(key)
        winner_taken = winner_taken or isinstance(action, SetMicroBatch)
        resolved.append((policy, action, None))
    return resolved


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What applying an action did: `applied` False means it was suppressed, `note` says why."""

    applied: bool
    note: str = ""


@functools.singledispatch
def apply(action: object, knobs: Knobs) -> Outcome:
    """Carry out `action` on `knobs`."""
    raise TypeError(f"no knob applies actions of type {type(action).__name__}")


@apply.register
def _set_micro_batch(action: SetMicroBatch, knobs: Knobs) -> Outcome:
    size = knobs.under_ceiling(min(max(1, int(action.size)), knobs.batch_size))
    if size == knobs.micro_batch_size:
        return Outcome(False, f"micro-batch is already {size}")
    old, knobs.micro_batch_size = knobs.micro_batch_size, size
    if knobs.device.type == "cpu":
        free_cpu_caches()  # MKL's buffers sized for the old micro-batch would stay mapped beside the new ones
    knobs._moved_past_given(old, f" ({action.reason})" if action.reason else "")
    return Outcome(True, f"micro-batch {old} -> {size}")


@apply.register
def _empty_cache(action: EmptyCache, knobs: Knobs) -> Outcome:
    before = device_sample(knobs.device, knobs.memory_cap_bytes).used_bytes
    free_memory(knobs.device)
    after = device_sample(knobs.device, knobs.memory_cap_bytes).used_bytes
    if before is None or after is None:
        return Outcome(True, "freed cached memory (amount not measurable here)")
    return Outcome(True, f"returned {format_bytes(before - after)}")


@apply.register
def _cache_samples(action: CacheSamples, knobs: Knobs) -> Outcome:
    if knobs.sample_cache is not None:
        return Outcome(False, "samples are already cached")
    knobs.sample_cache = action
    knobs.loader_version += 1
    return Outcome(True, "sample cache on from the next batch")


@apply.register
def _set_loader_workers(action: SetLoaderWorkers, knobs: Knobs) -> Outcome:
    workers = max(0, int(action.num_workers))
    if knobs.workers_ceiling is not None and workers > knobs.workers_ceiling:
        return Outcome(False, f"{workers} loader workers cannot start here (/dev/shm has no room for their "
                              f"queues): at most {knobs.workers_ceiling}")
    if workers == knobs.num_workers:
        return Outcome(False, f"already {workers} loader workers")
    old, knobs.num_workers = knobs.num_workers, workers
    knobs.loader_version += 1
    return Outcome(True, f"loader workers {old} -> {workers} from the next batch")


@apply.register(UseAutocast)
@apply.register(CheckpointActivations)
@apply.register(PruneChannels)
def _relief(action: Relief, knobs: Knobs) -> Outcome:
    if knobs.relief is not None:
        return Outcome(False, f"one relief at a time: {type(knobs.relief).__name__} goes first")
    knobs.relief = action
    return Outcome(True, "carried out before the next attempt")
