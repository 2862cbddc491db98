"""fit_micro_batch: go straight to the largest micro-batch that fits, predicted from what steps needed.

When: `Event.BATCH_MEASURED` (a step whose need was measured) and `Event.OOM` (a size that did not fit).
What: every step's need is measured (its peak above the memory in use when it began, against
the room the cap left: `Snapshot.step_memory`). Need is close to linear in the micro-batch
(the activations grow with it; weights, gradients and optimizer state do not), so from the
sizes run so far the policy fits `need = fixed + per_sample * size` and moves to the largest
size whose predicted need is within `headroom` of the room:
  - one size measured: the need is taken as all per-sample (proportional), which can only
    underestimate how far there is to grow, so the first move never overshoots on that count;
  - two or more: the line through the smallest and the largest, so the next move lands near
    the edge; each move is confirmed by the step that runs at it, which refines the line. What
    a step keeps in use (kernels compiled for a new shape, buffers built on first use) is left
    out of the line and added once to a move to a new size;
  - within `margin` of the prediction it stays: no oscillation;
  - on CPU under RLIMIT_AS, where the run's first step kept memory (heap that later steps reuse
    unseen), that step reads high beside the later ones and a line through it comes out too flat
    (it overshot by a fifth on resnet18 at 64x64): with one other size measured, its point enters
    the line lowered by what it kept; with two, it is left out. What it kept is not charged again
    as a new size's cost: the room is measured after it.
On OOM, with sizes measured, it moves to the prediction below the failed size; when the
prediction said the failed size would fit, the line is raised to agree with the failure (the
fixed part was more than it looked), so the next move is below it. A failure at or below a size
measured to fit says nothing about the line (something else took the room): halve_on_oom answers.
With nothing measured yet, a quarter of the failed size (halving, from 8x above, would take three
OOMs to get there).

Each OOM after the first measured step widens the margin kept below the room: 5% of it at first,
10% after one such OOM, then 20%, 40% (a need that drifts up over a run, an allocator's heap, an
EMA copy, shows as failures at sizes that fitted; each one asks for more slack). On such an OOM
it proposes the largest size whose last step left that margin free (halve_on_oom proposes too:
the smaller of the two is taken): where the failed size was above all that ran (the line
overshot), at least the largest size that ran scaled in proportion to its need; where a size
that ran failed, none below half of it (what a size measured long ago left free says nothing
now). After a size that had run fails, for `calm_steps` steps it does not move up, unless the
next measured step shows the room smaller by more than the failed size had spare (something else
took memory: a jump): then the sizes measured before are charged what was lost, the margin steps
back a notch (it was not what failed) and the run refits to the room left at once. After an
overshoot (a size that never ran) there is no calm: the next step's measure refines the line,
and a move up stays below the failure. Each `calm_steps` steps without an OOM narrow the margin
a notch again (a spike that passed). While a failure is remembered (`forget_failure_steps`) a
move up is bounded by what the sizes measured say: from the size that ran, the slack it left
(the room less its need) over the cost of a sample, the line's slope where two sizes are far
enough apart and, with one, between the whole of its need over it and what the failure implies
(`below_failure`), with a wider margin (a step after an OOM's clean-up regrows the heap, so it
shows what the batch costs from a trimmed heap).
torchvision's classification reference under its cap went 64, 16, 26, 21, 18 (four OOMs) on the
prediction alone; so bounded, two at most (tests/test_moving_in.py). The margin shapes the sizes
chosen after an OOM; it does not shrink a run before one (a need that creeps up while the size
stays is answered at its OOM).
Where a step's need cannot be measured it does nothing (grow_back doubles blind).

Parameters:
    headroom: the share of the room a step may be predicted to need (default 0.95).
    margin: stay when the prediction is within this fraction of the size (default 0.05).
    forget_failure_steps: steps after which a failed size may be tried again (default 2000).
    calm_steps: steps after an OOM without a move up, and without an OOM per notch the margin narrows
        back (default 50).

Owns: this policy's state (saved in checkpoints). Touches nothing: it reads a Snapshot and returns actions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Sequence

from autotune.common.actions import Action, SetMicroBatch
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot
from autotune.common.units import format_bytes
from autotune.common.validate import check_fraction, check_int


@dataclasses.dataclass
class FitMicroBatch:
    """Predict the largest micro-batch within `headroom` of the room from the needs measured so far, and go there."""

    name: ClassVar[str] = "fit_micro_batch"
    events: ClassVar[frozenset[Event]] = frozenset({Event.BATCH_MEASURED, Event.OOM})

    headroom: float = 0.95
    margin: float = 0.05
    forget_failure_steps: int = 2000
    calm_steps: int = 50

    needs: dict[int, int] = dataclasses.field(default_factory=dict, init=False, repr=False)  # size -> bytes
    raise_by: int = dataclasses.field(default=0, init=False, repr=False)  # bytes the failures added
    room: int | None = dataclasses.field(default=None, init=False, repr=False)
    new_size_cost: int = dataclasses.field(default=0, init=False, repr=False)  # kept by the first step at a size
    reliefs: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False)
    failed: int | None = dataclasses.field(default=None, init=False, repr=False)
    failed_step: int | None = dataclasses.field(default=None, init=False, repr=False)
    first: int | None = dataclasses.field(default=None, init=False, repr=False)  # the run's first measured size
    first_kept: int = dataclasses.field(default=0, init=False, repr=False)  # the heap that step kept
    whole_needs: dict[int, int] = dataclasses.field(default_factory=dict, init=False, repr=False)  # kept counted
    slack: dict[int, int] = dataclasses.field(default_factory=dict, init=False, repr=False)  # room - need, last step
    full_room: int = dataclasses.field(default=0, init=False, repr=False)  # the most room a step started with
    widened: int = dataclasses.field(default=0, init=False, repr=False)  # OOMs since the first measured step
    narrowed_step: int = dataclasses.field(default=0, init=False, repr=False)  # the margin's last notch back
    # An OOM at a size that had fit: the room then and what that size had spare, until the next
    # measured step tells whether the room shrank by more (something else took it: a jump).
    room_before_failure: int | None = dataclasses.field(default=None, init=False, repr=False)
    spare_at_failure: int = dataclasses.field(default=0, init=False, repr=False)
    room_lost: bool = dataclasses.field(default=False, init=False, repr=False)  # the last OOM was the room's
    failed_had_run: bool = dataclasses.field(default=True, init=False, repr=False)  # the last failure had fit before

    def __post_init__(self) -> None:
        check_fraction(self.name, "headroom", self.headroom)
        check_int(self.name, "forget_failure_steps", self.forget_failure_steps, 1)
        check_int(self.name, "calm_steps", self.calm_steps, 1)
        if not 0 <= self.margin < 1:
            raise ValueError(f"{self.name}: margin must be in [0, 1), got {self.margin!r}")

    # ------------------------------------------------------------------ the model of need
    def _points(self) -> dict[int, int]:
        # The sizes the line is fitted to. On CPU the run's first step reads high beside the later
        # ones by about the heap it kept: they reuse that heap out of sight of the virtual size
        # (resnet18 at 64x64, 320 MiB: kept 23 MiB, about 24 MiB above the line of the later sizes).
        # Its point enters the line lowered by what it kept while one other size is all there is
        # (left out, the second move would be proportional again: 47 to 105, where 48 to 127 now and
        # the plain loop fits 120); once two other sizes are measured, they alone set the line.
        if self.first is None or len(self.needs) < 2:
            return self.needs
        others = {size: need for size, need in self.needs.items() if size != self.first}
        if len(others) >= 2:
            return others
        return {**others, self.first: max(0, self.needs[self.first] - self.first_kept)}

    def predict_need(self, size: int) -> int | None:
        """Bytes a step at `size` is predicted to need; None before any size was measured."""
        if not self.needs:
            return None
        line = self._line()
        extra = self.raise_by + (self.new_size_cost if size not in self.needs else 0)
        if line is None:  # one size (or sizes too close to tell a slope): proportional to the largest
            points = self._points()
            measured = max(points)
            return points[measured] * size // measured + extra
        fixed, per_sample = line
        return int(fixed + per_sample * size) + extra

    def _line(self) -> tuple[float, float] | None:
        """(fixed, per-sample) bytes through the smallest and largest sizes, or None."""
        points = self._points()
        small, large = min(points), max(points)
        if large < small * 1.25:  # too close together: noise would set the slope
            return None
        per_sample = (points[large] - points[small]) / (large - small)
        if per_sample <= 0:
            return None
        return points[large] - per_sample * large, per_sample

    def largest_fitting(self, room: int) -> int | None:
        """The largest size predicted to need at most `headroom` of `room`; None before any size was measured."""
        if not self.needs:
            return None
        budget = self.share() * room - self.raise_by - self.new_size_cost
        line = self._line()
        if line is None:
            points = self._points()
            measured = max(points)
            return int(measured * budget / points[measured]) if points[measured] > 0 else None
        fixed, per_sample = line
        return int((budget - fixed) / per_sample)

    def share(self) -> float:
        """The share of the room a step may be predicted to need: `headroom`, less twice as much
        margin for each OOM since the first size was measured (at least half the room)."""
        return max(0.5, 1 - (1 - self.headroom) * 2 ** self.widened)

    def below_failure(self, size: int, failed: int) -> int:
        """The largest size above `size` (measured: its last step's slack, the room less the need)
        below `failed` that what was measured says fits within `share()` of the room: the slack
        over the cost of a sample. With two sizes far enough apart that cost is the line's slope;
        with one, the geometric mean of its whole need over it (every byte a sample's: the most a
        sample can cost) and what the failure implies (the slack over the sizes between: the
        least), with twice the margin; where the failure implies nothing below the first, that
        first alone, with four times the margin (resnet18 on CPU, 128 measured after an OOM at
        512: 0.84 MiB a sample measured, 223 with 5% kept did not fit; the larger sizes' kernels
        ask for more). The move measures a second size, so the line is there for the next one."""
        line = self._line()
        whole = self.whole_needs or self.needs  # a checkpoint from before whole needs were kept: the lower ones
        spare = self.slack.get(size, 0)
        if line is not None:
            per_sample, times = line[1], 1
        else:
            # Between two bounds: through zero (no fixed part: the most a sample can cost) and what
            # the failure says (it needed more than the room: at least `spare` over the sizes
            # between). Their geometric mean, with twice the margin: through zero alone, a run
            # whose fixed part was 60% of the room sat at half the size that fits.
            most = max(need / m for m, need in whole.items())
            least = spare / (failed - size) if failed > size else 0.0  # a size that failed once ran since
            per_sample, times = (math.sqrt(most * least), 2) if 0 < least < most else (most, 4)
        margin = (1 - self.share()) * times * self.full_room
        slack = spare - margin
        if per_sample <= 0 or slack <= 0:
            return size
        return max(size, min(failed - 1, size + int(slack / per_sample)))

    # ------------------------------------------------------------------ decisions
    def _recent_failure(self, step: int) -> int | None:
        if self.failed is None or self.failed_step is None or step - self.failed_step >= self.forget_failure_steps:
            return None
        return self.failed

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        if snap.reliefs != self.reliefs:  # the model changed: what it needed before says little now
            self.needs.clear()
            self.whole_needs.clear()
            self.slack.clear()
            self.raise_by, self.reliefs, self.first = 0, snap.reliefs, None
        if event is Event.OOM:
            return self._after_oom(snap)
        memory = snap.step_memory
        micro = snap.micro_batch_size
        if memory is None or memory.micro_batch_size != micro or memory.room_bytes <= 0:
            return []
        kept = max(0, memory.kept_bytes)
        # What a step keeps (kernels compiled for a new shape, buffers built on first use) is needed
        # once: the line is fitted to what repeats, and a move to a new size adds what the last
        # new size kept (the run's first step, which also built what any first step builds, at first).
        if not self.needs and self.first is None and kept > 0 and memory.kept_is_heap:
            self.first, self.first_kept = micro, kept
        if micro not in self.needs:
            # The heap the run's first step kept is room already gone (the room is measured after
            # it) that the next sizes reuse: charged again as a new size's cost, it made the first
            # move shorter (resnet18 at 64x64: 44, not 47, from 15).
            self.new_size_cost = 0 if micro == self.first else kept
        self.needs[micro] = max(self.needs.get(micro, 0), memory.need_bytes - kept)
        self.whole_needs[micro] = max(self.whole_needs.get(micro, 0), memory.need_bytes)
        self.slack[micro] = memory.room_bytes - memory.need_bytes
        self.full_room = max(self.full_room, memory.room_bytes)
        self.room = memory.room_bytes - kept  # the room the next step starts with
        if self.room_before_failure is not None:
            self._after_failure_measured(micro, memory.room_bytes)
        if (self.widened and self.failed_step is not None
                and snap.step - max(self.failed_step, self.narrowed_step) >= self.calm_steps):
            self.widened, self.narrowed_step = self.widened - 1, snap.step  # calm: the margin a notch back
        target = min(snap.batch_size, self.largest_fitting(self.room) or micro)
        failed = self._recent_failure(snap.step)
        if (self.widened and self.failed_step is not None and snap.step - self.failed_step < self.calm_steps
                and self.failed_had_run and not self.room_lost):
            return []  # an OOM since sizes were measured: no move up for a while (two OOMs at most)
        allowed = self.below_failure(micro, failed) if failed is not None and target > micro else target
        bounded = allowed < target
        target = min(target, allowed)
        if target <= micro + max(1, int(self.margin * micro)):
            return []  # within the margin of the prediction (or of what the failure allows): stay
        why = (f"{micro} works, {failed} failed at step {self.failed_step}: {target} is what the room {micro} left "
               "free allows" if bounded else
               f"needed {format_bytes(memory.need_bytes)} of {format_bytes(memory.room_bytes)} room at {micro}; "
               f"predicted to fit {target}")
        return [SetMicroBatch(target, reason=why)]

    def _after_failure_measured(self, micro: int, room: int) -> None:
        # The first measured step after an OOM at a size that had fit. A room smaller by more than
        # that size had spare explains the failure (something else took memory: another process,
        # a cache, an EMA copy made mid-run): what the sizes measured before left free is less by
        # as much, and the calm after the OOM is not needed: the line, the new room and the wider
        # margin say where to go now, bounded below the failure.
        lost = self.room_before_failure - room
        if lost > self.spare_at_failure:
            self.slack = {m: (slack if m == micro else slack - lost) for m, slack in self.slack.items()}
            self.room_lost = True
            self.widened = max(0, self.widened - 1)  # the margin was not what failed
        self.room_before_failure = None

    def _after_oom(self, snap: Snapshot) -> Sequence[Action]:
        size = snap.failed_micro_batch or snap.micro_batch_size
        known = self._recent_failure(snap.step)
        self.failed = size if known is None else min(known, size)
        self.failed_step = snap.step
        self.room_lost, self.room_before_failure = False, None
        if not self.needs or self.room is None:
            target = max(1, size // 4)
            return [SetMicroBatch(target, reason=f"out of memory at {size} with nothing measured yet; "
                                                 f"a quarter, {target}, to measure from")] if target < size else []
        self.widened += 1  # every OOM once sizes are measured: more slack from now on
        # The largest size whose last step left the (now wider) margin free: measured, not predicted.
        margin = (1 - self.share()) * self.full_room
        had_fit = size <= max(self.needs)
        self.failed_had_run = had_fit
        if had_fit:
            # It (or a larger size) ran: the room shrank or the need grew since. Sizes measured long
            # ago may have left much free then and say nothing now: none below what halving gives.
            self.room_before_failure = self.room
            self.spare_at_failure = min((slack for m, slack in self.slack.items() if m >= size), default=0)
        safe = [m for m, slack in self.slack.items()
                if m < size and slack >= margin and (not had_fit or m >= size // 2)]
        if had_fit and not safe:
            return []  # none left the margin: halve_on_oom answers, and the next step measures the room
        target = max(safe) if safe else 1
        why = f"{target} left {format_bytes(self.slack[target])} of the room free" if safe else f"{target}"
        if not had_fit:
            predicted = self.predict_need(size)
            if predicted is not None and predicted <= self.room:
                # It was predicted to fit and did not: the fixed part is larger than it looked.
                self.raise_by += self.room - predicted + 1
            # The line overshot: from the largest size that ran, in proportion to what it needed (a
            # need through zero grows at least as fast as a line with a fixed part), within the
            # wider margin. A CNN with BatchNorm at 13 and 51 samples set a line to 141 where 110
            # was the edge (the small size's need is mostly a fixed part the larger ones absorb).
            ran = max(self.needs)
            whole = self.whole_needs.get(ran, self.needs[ran])
            proportional = min(size - 1, int(ran * self.share() * self.room / whole)) if whole > 0 else 0
            if proportional > target:
                target, why = proportional, f"{proportional} in proportion to what {ran} needed"
        good = snap.last_good_micro_batch
        if good is not None and target < good < size and not had_fit:
            target, why = good, f"{good}, the size the last batch completed at"  # measured: better than a prediction
        return [SetMicroBatch(target, reason=f"out of memory at {size}; {why} ({1 - self.share():.0%} of the room kept "
                                             "from now on)")]

    def state_dict(self) -> dict[str, Any]:
        return {"needs": dict(self.needs), "raise_by": self.raise_by, "room": self.room,
                "new_size_cost": self.new_size_cost,
                "reliefs": list(self.reliefs), "failed": self.failed, "failed_step": self.failed_step,
                "first": self.first, "first_kept": self.first_kept, "whole_needs": dict(self.whole_needs),
                "slack": dict(self.slack), "full_room": self.full_room, "widened": self.widened,
                "narrowed_step": self.narrowed_step, "room_before_failure": self.room_before_failure,
                "spare_at_failure": self.spare_at_failure, "room_lost": self.room_lost,
                "failed_had_run": self.failed_had_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.needs = {int(k): int(v) for k, v in state.get("needs", {}).items()}
        self.raise_by, self.room = state.get("raise_by", 0), state.get("room")
        self.new_size_cost = state.get("new_size_cost", 0)
        self.reliefs = tuple(state.get("reliefs", ()))
        self.failed, self.failed_step = state.get("failed"), state.get("failed_step")
        self.first, self.first_kept = state.get("first"), state.get("first_kept", 0)
        self.whole_needs = {int(k): int(v) for k, v in state.get("whole_needs", {}).items()}
        self.slack = {int(k): int(v) for k, v in state.get("slack", {}).items()}
        self.full_room, self.widened = int(state.get("full_room", 0)), int(state.get("widened", 0))
        self.narrowed_step = int(state.get("narrowed_step", 0))
        self.room_before_failure = state.get("room_before_failure")
        self.spare_at_failure = int(state.get("spare_at_failure", 0))
        self.room_lost = bool(state.get("room_lost", False))
        self.failed_had_run = bool(state.get("failed_had_run", True))
