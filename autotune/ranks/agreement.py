"""The agreement: what every rank knows after an attempt at a batch, and how it travels.

Every rank proposes one after each attempt, failed or not (batch.py); under torchrun the
proposals meet in one all-reduce of ints (element-wise maximum), so the fields say how each
travels: the largest failed micro-batch any rank saw, rank 0's size and relief, a signal or a
due checkpoint any rank has, a fatal error's text gathered from whoever has one. Alone, the
proposal is the agreement (distributed.Solo).

Owns: the fields and their wire format. Touches nothing: distributed.py makes the collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.common.actions import Relief, relief_from_ints, relief_to_ints


def _wire(kind: str, default: Any = dataclasses.MISSING) -> Any:
    # How a field of the Agreement travels in the all-reduce (element-wise maximum of int64s):
    # "most": every rank's value, the largest wins ("most_or_none": 0 is None); "rank0": rank 0's
    # (the others send 0); "relief": rank 0's relief as two ints (actions.relief_to_ints); "why":
    # whether any rank has one, then the texts gathered (rare).
    return dataclasses.field(default=default, metadata={"wire": kind})


@dataclasses.dataclass(slots=True)  # not frozen: made every batch, and frozen doubles its __init__
class Agreement:
    """What every rank knows after an attempt at a batch (alone: what this process proposed).
    Its wire format under torchrun is made from these fields (`to_wire` / `from_wire`): a field
    added here travels with the rest."""

    failed_micro_batch: int | None = _wire("most_or_none")  # the largest that ran out of memory on any rank; None: none
    micro_batch_size: int = _wire("rank0")  # rank 0's: the size every rank uses next
    stop_signal: int = _wire("most", 0)  # a SIGTERM/SIGINT any rank received
    checkpoint_due: int = _wire("most", 0)  # CheckpointDue (checkpoint.py)
    relief: Relief | None = _wire("relief", None)  # rank 0's pending relief: every rank carries it out after this batch
    fatal: str | None = _wire("why", None)  # a rank cannot go on: why

    def to_wire(self, is_main: bool) -> list[int]:
        """This rank's proposal as the ints of the all-reduce."""
        values: list[int] = []
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), field.metadata["wire"]
            if kind in ("most", "most_or_none"):
                values.append(int(value or 0))
            elif kind == "rank0":
                values.append(int(value) if is_main else 0)
            elif kind == "relief":
                values.extend(relief_to_ints(value if is_main else None))
            else:  # "why"
                values.append(int(value is not None))
        return values

    def from_wire(self, values: list[int], is_main: bool, gather: Any) -> "Agreement":
        """The agreement, from the all-reduced ints and this rank's own proposal (`self`);
        `gather(obj)` collects every rank's text where any rank has one."""
        agreed: dict[str, Any] = {}
        at = 0
        for field in dataclasses.fields(self):
            kind, mine = field.metadata["wire"], getattr(self, field.name)
            if kind == "relief":
                code, ratio = values[at:at + 2]
                agreed[field.name] = mine if is_main else rank0s(code, ratio)
                at += 2
                continue
            value = values[at]
            at += 1
            if kind == "most_or_none":
                agreed[field.name] = value or None
            elif kind in ("most", "rank0"):
                agreed[field.name] = value
            else:  # "why": every rank learns what the failing ones saw
                agreed[field.name] = ("; ".join(f"rank {rank}: {text}" for rank, text in enumerate(gather(mine))
                                                if text) if value else None)
        return Agreement(**agreed)

    def is_quiet(self, last: "Agreement", is_main: bool) -> bool:
        """Whether this proposal says nothing that `last` (an agreement's quiet form, `quiet`) did
        not: no failure, signal, due checkpoint, relief or fatal error, and (rank 0) the same size."""
        for field in _FIELDS:
            value = getattr(self, field.name)
            if field.metadata["wire"] == "rank0":
                if is_main and value != getattr(last, field.name):
                    return False
            elif value is not None and value != 0:
                return False
        return True

    def quiet(self) -> "Agreement":
        """What a batch that says nothing new agrees after this one: rank 0's size, nothing else."""
        return Agreement(None, self.micro_batch_size)


_FIELDS = dataclasses.fields(Agreement)


def rank0s(code: int, ratio: int) -> Relief | None:
    """Rank 0's relief as another rank decodes it from an agreement or a broadcast."""
    return relief_from_ints(code, ratio, reason="rank 0's policies asked for it")

