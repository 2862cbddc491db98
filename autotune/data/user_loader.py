"""A DataLoader the caller built, resumed in the middle of an epoch on the same samples.

autotune cannot start a caller's loader mid-epoch, so a resume replays the batches already
trained and drops them. A shuffled loader draws its epoch's order when it is iterated (its
sampler's permutation, the workers' base seed), from the loader's or the sampler's
`generator`, or from torch's global random state when it has none: a fresh `iter()` after a
restart would draw another order, training some samples twice and others never. So at the
start of each epoch the random states the order is drawn from are kept (a few KiB, saved in
each checkpoint); a resume puts them back before the replay, and then returns the global
states to the checkpoint's, so training continues as if never stopped.

A loader with `state_dict()`/`load_state_dict()` (torchdata's `StatefulDataLoader`) is
resumed through them instead, without a replay. Where the order may come from elsewhere (an
`IterableDataset`, a sampler of the user's own), the replay is exact only if that order is a
function of the same random states; a resume says so where it cannot tell.

Owns: the random states and position of a caller's DataLoader. Touches the loader's sampler's
generator (to replay an epoch's order), nothing of its data.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from autotune.common.notices import warn
from autotune.run_folder.rng import rng_state, set_rng_state

# Samplers whose order is drawn only from their generator, torch's global state, or (seed, epoch).
KNOWN_SAMPLERS = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler)


def stateful(loader: Any) -> bool:
    """Whether the loader saves and restores its own position (torchdata's StatefulDataLoader)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def generators(loader: DataLoader) -> dict[str, torch.Generator]:
    """The generators iterating `loader` draws from, each once, by where it sits."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    places = {"loader": loader, "sampler": getattr(loader, "sampler", None),
              "batch_sampler": batch_sampler, "batch_sampler.sampler": getattr(batch_sampler, "sampler", None)}
    found: dict[str, torch.Generator] = {}
    for name, holder in places.items():
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found.values()):
            found[name] = generator
    return found


def _sampler_of(loader: DataLoader) -> Any:
    # What draws the order: the batch sampler's sampler, a batch sampler of the user's own, or the sampler.
    if isinstance(loader.batch_sampler, BatchSampler) and loader.batch_sampler.sampler is not None:
        return loader.batch_sampler.sampler
    if loader.batch_sampler is not None and not isinstance(loader.batch_sampler, BatchSampler):
        return loader.batch_sampler
    return loader.sampler


def input_of(loader: DataLoader) -> dict[str, Any]:
    """What a caller's loader's order depends on that a checkpoint can hold and a resume compare:
    its dataset's length (None: an IterableDataset's stream, which `why_not_exact` speaks of) and
    its sampler's kind. Its seed is not asked: the random states it draws from travel in the
    checkpoint (`UserLoaderPosition`)."""
    try:
        length: int | None = len(loader.dataset)
    except TypeError:
        length = None
    return {"length": length, "sampler": type(_sampler_of(loader)).__name__}


def why_not_exact(loader: DataLoader) -> str | None:
    """Why a replay of `loader` may not give the same samples (None: it will)."""
    if isinstance(loader.dataset, IterableDataset):
        return (f"its dataset is an IterableDataset ({type(loader.dataset).__name__}): the replay is exact only if "
                "its stream is a function of torch's, numpy's and Python's random states")
    sampler = _sampler_of(loader)
    if not isinstance(sampler, KNOWN_SAMPLERS):
        return (f"its sampler is a {type(sampler).__name__}: the replay is exact only if its order is a function of "
                "torch's, numpy's and Python's random states or its `generator`")
    return None


class UserLoaderPosition:
    """Where a caller's loader is in its epoch, in a form a checkpoint keeps (`state_dict`), and
    the batches of a resumed epoch from there (`batches`)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self._epoch_start: dict[str, Any] | None = None  # the random states this epoch's order came from
        self._restored: dict[str, Any] | None = None  # a checkpoint's, until the next `batches`

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: the loader's own state, or the random states of the epoch's start
        and the generators' now."""
        if stateful(self.loader):
            return {"loader": self.loader.state_dict()}
        return {"epoch_start": self._epoch_start,
                "generators": {name: g.get_state() for name, g in generators(self.loader).items()}}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take a checkpoint's `state_dict()` (None: a checkpoint from before it was saved); the next
        `batches` call uses it."""
        self._restored = state

    def batches(self, batches_done: int) -> Iterator[Any]:
        """An iterator over the epoch's batches after the first `batches_done`."""
        restored, self._restored = self._restored, None
        if stateful(self.loader):
            if restored is not None and "loader" in restored:
                # It resumes where it was, replaying nothing; what a new iterator draws (its
                # workers' base seed) comes from the random states of the checkpoint, which then
                # go back to how they were for the training that follows, as in the run never stopped.
                at_checkpoint = rng_state()
                self.loader.load_state_dict(restored["loader"])
                batches = iter(self.loader)
                set_rng_state(at_checkpoint)
                return batches
            return self._replay(batches_done, "it was saved without its loader's state")
        if restored is not None:
            for name, g in generators(self.loader).items():  # as they were at the checkpoint
                if name in restored.get("generators", {}):
                    g.set_state(restored["generators"][name])
        if batches_done == 0:
            self._epoch_start = {"rng": rng_state(),
                                 "generators": {name: g.get_state() for name, g in generators(self.loader).items()}}
            return iter(self.loader)
        if restored is None or restored.get("epoch_start") is None:
            return self._replay(batches_done, "the checkpoint does not hold the random states its epoch started from")
        # The epoch's order drawn again from the states it came from; then the global states
        # back to the checkpoint's, for the training that follows.
        at_checkpoint = rng_state()
        start = restored["epoch_start"]
        set_rng_state(start["rng"])
        for name, g in generators(self.loader).items():
            if name in start["generators"]:
                g.set_state(start["generators"][name])
        self._epoch_start = start
        why = why_not_exact(self.loader)
        if why is not None:
            warn(f"resuming your DataLoader mid-epoch by replaying its first {batches_done} batches: {why}. "
                 "torchdata's StatefulDataLoader resumes exactly.", key="user loader replay")
        batches = iter(self.loader)
        _skip(batches, batches_done)
        set_rng_state(at_checkpoint)
        drifted = [name for name, g in generators(self.loader).items()
                   if name in restored.get("generators", {}) and not torch.equal(g.get_state(),
                                                                                 restored["generators"][name])]
        if drifted:
            warn(f"replaying the first {batches_done} batches of your DataLoader left its {', '.join(drifted)} "
                 "generator elsewhere than at the checkpoint: the rest of this epoch may not be the samples the "
                 "run would have trained", key="user loader drift")
        return batches

    def _replay(self, batches_done: int, why: str) -> Iterator[Any]:
        batches = iter(self.loader)
        if batches_done:
            warn(f"resuming your DataLoader mid-epoch by skipping its first {batches_done} batches of a fresh "
                 f"iteration, and {why}: a shuffled order is drawn anew, so some samples of this epoch may be "
                 "trained twice and others not at all", key="user loader unsafe resume")
            _skip(batches, batches_done)
        return batches


def _skip(batches: Iterator[Any], n: int) -> None:
    """Drop the first `n` batches. In a single-process loader over a map-style dataset only the
    indices are drawn (the samples are never loaded); otherwise the batches are loaded and dropped."""
    next_index = getattr(batches, "_next_index", None)  # torch's single-process iterator
    single = type(batches).__name__ == "_SingleProcessDataLoaderIter"
    dataset = getattr(batches, "_dataset", None)
    if single and callable(next_index) and not isinstance(dataset, IterableDataset):
        for _ in range(n):
            next_index()
        batches._num_yielded += n  # type: ignore[attr-defined]
        return
    for _ in range(n):
        next(batches)
