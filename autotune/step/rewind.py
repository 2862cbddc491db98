"""What an attempt changes besides gradients, put back when it fails: the random streams and the
buffers a forward updates, so that the retry runs as if the failed attempt never had.

    keep()      before an attempt (stepping every micro-batch: before each chunk): the CPU stream
                and the device's, and a copy of each buffer a forward changes (BatchNorm's running
                statistics and `num_batches_tracked`, any buffer written in place)
    restore()   after a failed attempt, before its retry: all of them as kept
    restore_buffers()  after an attempt whose optimizer step was skipped on non-finite gradients:
                the buffers only (a NaN batch's running statistics, norm_stats.py's fold too)

A run whose OOMs are retried at the same split is then bit-equal to one without them: the retry's
dropout masks are the ones the failed attempt drew, and running statistics are updated once per
forward that counts. autotune's own fault-injection stream is not rewound (the retry would draw
the same fault).

Whether an attempt draws from the streams is learned from the first one (a model without dropout
never pays for a copy of them again; `forget` learns anew). Which buffers a forward changes is
learned too, not guessed, because a model may hold large ones it
never writes (a GPT's causal mask: megabytes a step to copy): every buffer is copied before the
first attempt, and those whose values moved during it are copied from then on, with the running
statistics of every normalisation module (in eval mode at first, they may train later). A buffer
written later for the first time (its in-place version moved) joins them at the next attempt.
BatchNorm's kernels write the running statistics without moving that version, which is why the
first attempt compares values. `forget()`: a relief changed the model's modules; learn again.

A skipped step's batch is consumed, not retried, so `restore_buffers` leaves the random streams
where the attempt left them: rewinding them would only hand its dropout masks to the next batch,
and a loop that checks its own gradients and skips the step (the reference a user has) draws them
too. The buffers are what must go back: a NaN sample leaves NaN running statistics for good (every
later checkpoint refused, evaluation broken) though the weights never saw it.

Owns: the copies and the kept streams. Touches: the model's buffers and the random streams, only
in `restore` (the buffers in `restore_buffers`). Used by step/core.py only: `keep` before an
attempt, `restore` from its `Attempt.roll_back` (once every rank agreed it failed); it hands
`restore_buffers` to the optimizer step, which calls it on a skip.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


class Rewind:
    """The state an attempt may change outside its gradients, kept and put back (see the module docstring)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model = model
        self.on_cuda = device.type == "cuda"  # asked once: a torch.device's .type is a slow read
        self.device = device
        self._cpu_stream: torch.Tensor | None = None
        self._device_stream: torch.Tensor | None = None
        self._watched: list[torch.Tensor] | None = None  # the buffers copied before each attempt
        self._copies: list[torch.Tensor] = []
        self._learning = False  # the first attempt's copies are of every buffer, to see which move
        self._others: list[tuple[torch.Tensor, int]] = []  # the rest, with their in-place versions
        self._restored = False  # the last attempt was put back (it taught nothing of what moves)
        self.streams_move: bool | None = None  # whether an attempt draws random numbers (None: not seen yet)
        self._first: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the streams at that attempt's start
        self._nothing = False  # learned: nothing to keep (see `_settled`)

    def keep(self) -> None:
        """Before an attempt: the random streams and the changing buffers as they are now."""
        if self._nothing:
            return  # learned: no draws, no buffer a forward writes, none to watch
        if self.streams_move is not False:
            self._cpu_stream = torch.get_rng_state()
            if self.on_cuda:
                self._device_stream = torch.cuda.get_rng_state(self.device)
            if self.streams_move is None and self._first is None:  # what `attempted` compares with
                self._first = (self._cpu_stream, self._device_stream)
        if self._watched is None:  # the first attempt: every buffer, once
            self._watched = list(self.model.buffers())
            self._copies = [b.detach().clone() for b in self._watched]
            self._learning = True
            return
        if self._learning and not self._restored:
            self._learn()  # an attempt ran to its end since every buffer was copied
        self._restored = False
        moved = [b for b, version in self._others if b._version != version]
        if moved:  # written in place for the first time since the first attempt
            self._watch(moved)
        if self._watched:
            torch._foreach_copy_(self._copies, self._watched)

    def attempted(self, whole: bool) -> None:
        """After the first attempt that ran to its end (`whole`; and the first after `forget`):
        whether it drew from the random streams. A model that draws nothing (no dropout) then never
        pays for keeping them: a copy of the CPU stream is ~5 KB, ~10 us of a ~0.3 ms step on a
        cold cache. A failed attempt may have stopped before its first draw: it teaches nothing."""
        if self.streams_move is not None or self._first is None or not whole:
            return
        cpu, device = self._first
        self._first = None
        moved = not torch.equal(torch.get_rng_state(), cpu)
        if device is not None:
            moved = moved or not torch.equal(torch.cuda.get_rng_state(self.device), device)
        self.streams_move = moved
        if not moved:
            self._cpu_stream = self._device_stream = None  # nothing of the streams to put back, ever
        self._settled()

    def restore(self) -> None:
        """After a failed attempt: the random streams and the changing buffers as `keep` found them."""
        if self._cpu_stream is not None:
            torch.set_rng_state(self._cpu_stream)
        if self._device_stream is not None:
            torch.cuda.set_rng_state(self._device_stream, self.device)
        if self._watched:
            torch._foreach_copy_(self._watched, self._copies)
        self._restored = True  # learning waits for an attempt that runs to its end

    def restore_buffers(self) -> bool:
        """After an attempt whose optimizer step was skipped (non-finite gradients): the changing
        buffers as `keep` found them; the random streams stay as they are (see the module
        docstring). Whether there were any to put back."""
        if not self._watched:
            return False  # none a forward writes
        torch._foreach_copy_(self._watched, self._copies)
        self._restored = True  # as after `restore`: values put back teach nothing of what moves
        return True

    def forget(self) -> None:
        """The model's modules changed (a relief): its buffers, and whether it draws, learned again."""
        self._watched, self._copies, self._others, self._learning = None, [], [], False
        self.streams_move, self._first, self._nothing = None, None, False

    def _learn(self) -> None:
        # The buffers whose values the first whole attempt changed, and the norms' own (a model in
        # eval mode at first trains later); the rest are watched by their in-place versions.
        norms = {id(b) for m in self.model.modules() if isinstance(m, _NormBase) for b in m.buffers()}
        moved = [(b, c) for b, c in zip(self._watched, self._copies) if id(b) in norms or not _same(b, c)]
        kept = {id(b) for b, _ in moved}
        self._others = [(b, b._version) for b in self._watched if id(b) not in kept]
        self._watched, self._copies = [b for b, _ in moved], [c for _, c in moved]
        self._learning = False
        self._settled()

    def _settled(self) -> None:
        # Nothing to keep before an attempt: a model without buffers or draws (most small ones).
        self._nothing = (self.streams_move is False and not self._learning and self._watched is not None
                         and not self._watched and not self._others)

    def _watch(self, buffers: list[torch.Tensor]) -> None:
        ids = {id(b) for b in buffers}
        self._watched += buffers
        self._copies += [b.detach().clone() for b in buffers]
        self._others = [(b, v) for b, v in self._others if id(b) not in ids]


def _same(a: torch.Tensor, b: Any) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))
