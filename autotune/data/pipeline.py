"""The trainer's data side: build the DataLoader, see when the loop waits on it, and rebuild it
(more workers, a shared sample cache) at a batch boundary without changing the sample order.

The order is `EpochSampler`'s, a function of (seed, epoch) that can start mid-epoch: a
rebuilt loader continues at the same position, so switching mid-epoch skips and repeats
nothing. A DataLoader the caller built is used as it is and never rebuilt; user_loader.py
resumes it mid-epoch on the same samples.

Owns: the DataLoader built here, its rebuilds, the input profile, the sample cache's lifetime.
Touches: the journal; the knobs, read only (the workers and the cache policies asked for) but for
the workers' count and ceiling where they cannot start (no room in /dev/shm for their queues: the
loader falls back to loading in this process); a caller's DataLoader only to read its position
(user_loader.py).
"""

from __future__ import annotations

import collections
import os
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from loguru import logger
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from autotune.common.actions import CacheSamples
from autotune.common.batching import map_tensors
from autotune.common.events import Event
from autotune.common.notices import warn
from autotune.common.shared_memory import no_room
from autotune.common.snapshot import InputProfile, InputState, StepTiming
from autotune.common.units import format_bytes
from autotune.data.cache import CachedDataset, NotCacheable, SampleCache, cache_budget, profile_input, split_for_caching
from autotune.data.sampler import EpochSampler
from autotune.data.tensors import batched_view, take_batch
from autotune.data.user_loader import UserLoaderPosition, input_of
from autotune.decisions.detectors import InputDetector
from autotune.memory.figures import device_sample
from autotune.observe.journal import Journal
from autotune.observe.records import Kind
from autotune.ranks.process import Process
from autotune.stops.preemption import DEFAULT_STOP_SIGNALS, WorkerStops


class UnlikeTheOthers(ValueError):
    """A sample that loads, but is not shaped as the rest of its batch (`find_bad_sample`)."""


def shape_of(sample: Any) -> str:
    """A sample's structure in words, what a collate needs alike in every sample of a batch:
    "(Tensor[3, 32, 32], int)", "None", "{'input_ids': Tensor[128]}"."""
    if sample is None:
        return "None"
    if hasattr(sample, "shape") and not isinstance(sample, type):
        return f"{type(sample).__name__}{list(sample.shape)}"
    if isinstance(sample, (list, tuple)):
        return "(" + ", ".join(shape_of(item) for item in sample) + ")"
    if isinstance(sample, dict) or hasattr(sample, "keys") and hasattr(sample, "__getitem__"):
        return "{" + ", ".join(f"{key!r}: {shape_of(sample[key])}" for key in sample.keys()) + "}"
    return type(sample).__name__


_INPUT_NAMES = {"length": "the dataset's length", "seed": "seed", "shuffle": "shuffle", "sampler": "the sampler"}


def changed_input(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's `InputPipeline.input()` and this run's, in words (a key
    the checkpoint lacks, an older autotune's, is not compared)."""
    return [f"{name} {saved[key]!r} in the checkpoint, {now[key]!r} now" for key, name in _INPUT_NAMES.items()
            if key in saved and key in now and saved[key] != now[key]]


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers often narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def batches_on_host(batch: Any) -> bool:
    """Whether every tensor of `batch` is in host memory, so a CUDA run pins it (the loader's
    pinning raises "cannot pin 'torch.cuda.FloatTensor'" on a tensor already on the device)."""
    devices: set[str] = set()
    map_tensors(lambda tensor: devices.add(tensor.device.type), batch)
    return devices <= {"cpu"}


def workers_without_room(num_workers: int, exc: OSError) -> str:
    """Why a caller's DataLoader's workers did not start where /dev/shm is full, and the ways out."""
    return (f"your DataLoader's {num_workers} workers could not start ({os.strerror(exc.errno)}): torch makes "
            "their queues' semaphores in /dev/shm, which has no room. Give it more (docker run --shm-size=1g, or "
            "free /dev/shm), or pass num_workers=0 to your DataLoader. AUTOTUNE_SHM_DIR moves only autotune's own "
            "boards and caches, not torch's workers; the DataLoader autotune builds (pass the Dataset) falls "
            "back to num_workers=0 by itself")


def _end_half_made(exc: BaseException) -> None:
    # torch's iterator that raised in its __init__ (private: found in the traceback's frames): the
    # workers it had started (all but the one whose queue failed) are stopped now, not at exit, and
    # its __del__, which would trip over the attributes it never set, is told there is nothing to do.
    frame_of = exc.__traceback__
    while frame_of is not None:
        half = frame_of.tb_frame.f_locals.get("self")
        if type(half).__name__ == "_MultiProcessingDataLoaderIter":
            for worker in getattr(half, "_workers", []):
                worker.terminate()
                worker.join(timeout=5)
            half._shutdown = True
            return
        frame_of = frame_of.tb_next


class InputPipeline:
    """Owns the DataLoader of a run: built from a map-style dataset, or the caller's own."""

    def __init__(self, dataset: Dataset | DataLoader, *, batch_size: int, shuffle: bool, seed: int,
                 num_workers: int, collate_fn: Callable[[list], Any] | None, device: torch.device,
                 ranks: Process, stop_signals: Sequence[int] = DEFAULT_STOP_SIGNALS):
        self.seed = seed
        self.worker_stops = WorkerStops(stop_signals)  # what the workers built here do with a group's stop signal
        self.device = device
        self.detector = InputDetector()
        self.profile: InputProfile | None = None
        self.cache: SampleCache | None = None
        self._skip_next = False  # the first batch of a new loader waits on its workers starting
        self.built_for = 0  # the knobs' loader_version this loader was built for (knobs.py bumps it)
        self._handed_out: weakref.ref | None = None  # the iterator of the epoch's batches, once built here
        self.max_workers: int | None = None  # where workers could not start: the most this run uses (0)
        self._knobs: Any = None  # the trainer's, once bound: told when the workers cannot start
        self._journal: Journal | None = None
        if isinstance(dataset, DataLoader):
            if dataset.batch_size is None:
                raise ValueError("the DataLoader must have a batch_size (it is the batch of one optimizer step)")
            self.dataset, self.sampler, self.loader = dataset.dataset, None, dataset
            self.num_workers = dataset.num_workers
            self.user_position = UserLoaderPosition(dataset)
            return
        if isinstance(dataset, IterableDataset):
            raise TypeError("an IterableDataset must come wrapped in a DataLoader (its batch_size is the batch)")
        if not isinstance(dataset, Dataset) and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(f"dataset must be a map-style torch Dataset or a DataLoader, got {type(dataset).__name__}")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty: there is nothing to train on")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        self.dataset = dataset
        # Tensors in memory, default collate: a batch is one gather per tensor (data/tensors.py).
        self._gathered = batched_view(dataset) if collate_fn is None else None
        self.sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=seed,
                                    rank=ranks.rank, world=ranks.world, batch_size=batch_size)
        self._batch_size, self._collate_fn = batch_size, collate_fn
        self._pin = device.type == "cuda" and batches_on_host(self._probe_batch())
        self.num_workers = num_workers
        self.loader = self._build(dataset, num_workers)

    def bind(self, knobs: Any, journal: Journal) -> None:
        """The trainer's knobs (told the workers in use, and where they cannot start, the ceiling)
        and journal (where a fallback to in-process loading is recorded)."""
        self._knobs, self._journal = knobs, journal
        knobs.workers_in_use(self.num_workers)

    @property
    def owned(self) -> bool:
        """Built here (so it can be rebuilt), not the caller's DataLoader."""
        return self.sampler is not None

    @property
    def gathered(self) -> bool:
        """Whether a batch is fetched by one gather per tensor in memory (a TensorDataset): a loader
        worker could only make the same gather and send the batch back."""
        return self.owned and self._gathered is not None

    def _build(self, dataset: Dataset, num_workers: int) -> DataLoader:
        collate_fn = self._collate_fn
        if dataset is self.dataset and self._gathered is not None:
            dataset, collate_fn = self._gathered, take_batch
        return DataLoader(
            dataset, batch_size=self._batch_size, sampler=self.sampler, num_workers=num_workers,
            collate_fn=collate_fn, pin_memory=self._pin,
            generator=torch.Generator().manual_seed(self.seed),  # worker seeds follow `seed`
            worker_init_fn=self.worker_stops.worker_init_fn() if num_workers else None,
        )

    def _probe_batch(self) -> Any:
        # A batch of the first sample, as the loader will make it: on CUDA, whether to pin depends on
        # where the dataset (or the collate) puts its tensors. A sample that cannot be read is the
        # first batch's error to raise, where the loop checkpoints and names the batch.
        try:
            if self._gathered is not None:
                return self._gathered.__getitems__([0])
            return (self._collate_fn or default_collate)([self.dataset[0]])
        except Exception as exc:  # noqa: BLE001 - any error of the user's dataset: see above
            logger.debug(f"batches pinned on CUDA: the first sample could not be read ({type(exc).__name__}: {exc})")
            return None

    def planned_batches(self, progress: Any, epochs: int, max_steps: int | None, keep_effective_batch: bool) -> int | None:
        """Batches left until `epochs` (or `max_steps`) are done, for a progress bar; None if unknown."""
        try:
            total = (epochs - progress.epoch) * len(self.loader) - progress.batches_done
        except TypeError:  # a loader without a length
            return None if max_steps is None else max_steps - progress.step
        if max_steps is not None and keep_effective_batch:
            total = min(total, max_steps - progress.step)
        return max(total, 0)

    def batches(self, epoch: int, position: int, batches_done: int, padded_for: int | None = None,
                step: int = 0) -> Iterator[Any]:
        """The batches of `epoch`, from sample `position` on (`batches_done` batches in);
        `padded_for`: the number of ranks the epoch began on (EpochSampler), if not this job's;
        `step`: the optimizer steps done, for the journal."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, start=position, padded_for=padded_for)  # a resumed epoch goes on
            self.loader.generator.manual_seed(self.seed + epoch)  # worker seeds: a function of the epoch
        elif hasattr(getattr(self.loader, "sampler", None), "set_epoch"):
            self.loader.sampler.set_epoch(epoch)  # e.g. a user's DistributedSampler
        if self.sampler is None:
            try:
                return self.user_position.batches(batches_done)
            except OSError as exc:
                if self.loader.num_workers and no_room(exc):
                    _end_half_made(exc)
                    raise OSError(exc.errno, workers_without_room(self.loader.num_workers, exc)) from exc
                raise
        try:
            iterator = iter(self.loader)
        except OSError as exc:
            if not (self.loader.num_workers and no_room(exc)):
                raise
            # The workers' queues are semaphores in /dev/shm: where it is full they cannot be made,
            # and a resume asking for the same workers would fail at the same batch every time.
            _end_half_made(exc)
            self._workers_cannot_start(exc, step, epoch, position)
            iterator = iter(self.loader)
        self._handed_out = weakref.ref(iterator)  # weak: an epoch's end or a rebuild still frees it
        return self._served(iterator) if self.loader.num_workers else iterator

    def _workers_cannot_start(self, exc: OSError, step: int, epoch: int, position: int) -> None:
        asked, self.max_workers = self.loader.num_workers, 0
        self.set_workers(0)
        if self._knobs is not None:
            self._knobs.workers_cannot_start(0)
        if self._journal is not None:
            self._journal.write(Kind.LOADER_REBUILT, step, epoch, num_workers=0, cache=self.cache is not None,
                                position=position, asked_workers=asked, reason=f"{type(exc).__name__}: {exc}")
        warn(f"{asked} data loader workers could not start ({exc}): /dev/shm has no room for their queues. "
             "Loading in this process from now on (this run adds no workers); give the container more "
             "shared memory (docker run --shm-size=1g) for workers")
        logger.info(f"data loader rebuilt: 0 workers ({asked} could not start)")

    def _served(self, iterator: Iterator[Any]) -> Iterator[Any]:
        # The workers ignore a stop signal until their trainer stops them (preemption.WorkerStops): an
        # epoch left early (max_steps, a stop asked for, a rebuild) ends them as an error does, so a
        # worker stuck in __getitem__ still ends at torch's terminate() instead of holding the exit.
        try:
            yield from iterator
        except GeneratorExit:
            self._shut_down(iterator)
            raise

    def stop_workers(self) -> None:
        """Stop the worker processes of the epoch's batches now (the loader built here; a caller's
        DataLoader is theirs to stop). An error that ends `fit` carries that iterator in its traceback:
        its workers would live as long as the exception, and where a garbage cycle holds it, torch's
        shutdown at collection finds the workers' queues finalized first and waits its 5 s timeout
        for each worker before killing it (a user's later gc.collect() took 10 s with two)."""
        self._shut_down(self._handed_out() if self._handed_out is not None else None)

    def _shut_down(self, iterator: Any) -> None:
        shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's own (private): where absent, gc does it
        if shutdown is not None:
            with self.worker_stops.stopping():  # they ignore the stop signals until now (preemption.py)
                shutdown()

    def set_batch_size(self, batch_size: int) -> None:
        """Each rank's batch from now on (a resume on another number of ranks keeps the job's):
        the loader is built anew, and takes effect at the next `batches`."""
        if not self.owned:
            raise ValueError("a resume on another number of ranks re-splits the job's batch between them, which "
                             "needs the DataLoader autotune builds: pass the Dataset, not your DataLoader")
        self._batch_size = self.sampler.batch_size = batch_size
        self.loader = self._build(self._cached if self.cache is not None else self.dataset, self.num_workers)

    def describe_batch(self, epoch: int, position: int, batches_done: int) -> str:
        """The batch that starts at sample `position` of `epoch`, in words: with its dataset
        indices where this pipeline's sampler knows them (at most 64 named)."""
        where = f"the error came while loading or training batch {batches_done + 1} of epoch {epoch + 1}"
        if self.sampler is None:
            return where
        indices = self._batch_indices(position)
        shown = ", ".join(map(str, indices[:64])) + (", ..." if len(indices) > 64 else "")
        return f"{where}, the dataset's samples [{shown}]"

    def find_bad_sample(self, epoch: int, position: int) -> tuple[int, Exception] | None:
        """The first sample of the batch at `position` of `epoch` that fails to load, fetched one at
        a time in this process, with its exception: what a worker's error or a collate's does not
        name. Where each loads, the one unlike the others (None, or a tensor of another shape: what
        the collate's error does not name), as an `UnlikeTheOthers`. None where the indices are
        unknown (a caller's loader) or the samples load alone and are alike."""
        if self.sampler is None:
            return None
        shapes: dict[int, str] = {}
        for index in self._batch_indices(position):
            try:
                shapes[index] = shape_of(self.dataset[index])
            except Exception as exc:  # the sample's own error, named for the user (not raised again)
                return index, exc
        usual, _ = collections.Counter(shapes.values()).most_common(1)[0]
        odd = next((index for index, shape in shapes.items() if shape != usual), None)
        if odd is None:
            return None
        return odd, UnlikeTheOthers(f"it is {shapes[odd]} where the batch's other samples are {usual}")

    def batch_indices(self, position: int) -> list[int] | None:
        """The dataset indices of the batch at sample `position` of this epoch; None for a caller's loader."""
        return None if self.sampler is None else self._batch_indices(position)

    def _batch_indices(self, position: int) -> list[int]:
        # The dataset indices of the batch starting at sample `position` (the sampler is at its epoch).
        return self.sampler.order()[position:position + self._batch_size]

    def input(self) -> dict[str, Any]:
        """What the order of the samples is a function of, kept in every checkpoint (`changed_input`):
        the dataset's length, and the seed, shuffle and sampler of the loader built here (of a
        caller's loader: `user_loader.input_of`)."""
        if not self.owned:
            return input_of(self.loader)
        return {"length": len(self.dataset), "seed": self.seed, "shuffle": self.sampler.shuffle,
                "sampler": type(self.sampler).__name__}

    def state_dict(self) -> dict[str, Any]:
        """A caller's loader's position, for a checkpoint (per rank); {} for the loader built here,
        whose order is a function of (seed, epoch, position)."""
        return {} if self.owned else self.user_position.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore what `state_dict` returned: the next `batches` continues from it."""
        if not self.owned:
            self.user_position.load_state_dict(state or None)

    # ------------------------------------------------------------------------- watching
    def on_step(self, timing: StepTiming, samples: int, journal: Journal, step: int, epoch: int,
                profile: bool = True) -> list[Event]:
        """Feed one step's timing; returns [Event.IO_BOUND] when the loop waits on its data. The
        first time, the dataset's load/decode is timed apart from its transforms (once per run: it
        reads a few samples) and journaled, so the policies asked about IO_BOUND see the profile;
        `profile=False` where no policy listens (the reading costs a fraction of a second)."""
        if self._skip_next:
            self._skip_next = False
            return []
        events = self.detector.on_step(timing, samples)
        if events and profile and self.profile is None:
            self.profile = self._profile()
            journal.write(Kind.INPUT_PROFILE, step, epoch, load_ms=round(self.profile.load_seconds * 1e3, 3),
                          transform_ms=round(self.profile.transform_seconds * 1e3, 3),
                          load_share=round(self.profile.load_share, 3), samples=self.profile.samples,
                          cacheable=self.profile.cacheable, how=self.profile.how,
                          verdict=self._verdict(self.profile))
        return events

    def state(self) -> InputState:
        """The pipeline now, for a snapshot (reads figures only)."""
        wait, rate, steps = self.detector.summary()
        return InputState(data_wait_fraction=wait, samples_per_second=rate, steps=steps, num_workers=self.num_workers,
                          cpu_cores=cpu_cores(), loader_owned=self.owned, cache_active=self.cache is not None,
                          profile=self.profile, gathered=self.gathered, max_workers=self.max_workers)

    def _profile(self) -> InputProfile:
        if not self.owned:
            return InputProfile(0.0, 0.0, 0, False, "the DataLoader was built by the caller: it is used as it is")
        return profile_input(self.dataset, seed=self.seed)

    @staticmethod
    def _verdict(profile: InputProfile) -> str:
        if not profile.cacheable:
            return "not cacheable"
        return "load/decode dominates" if profile.load_share >= 0.5 else "transforms dominate"

    # ------------------------------------------------------------------------- rebuilding
    def stale(self, knobs: Any) -> bool:
        """Whether a policy changed the workers or the cache since this loader was built."""
        return knobs.loader_version != self.built_for

    def rebuild(self, knobs: Any, journal: Journal, step: int, epoch: int, position: int) -> Iterator[Any]:
        """A new loader with the knobs' workers and (if asked) the sample cache, continuing `epoch`
        at `position`."""
        self.built_for, num_workers, cache = knobs.loader_version, knobs.num_workers, knobs.sample_cache
        if cache is not None and self.cache is None:
            self._start_cache(cache, journal, step, epoch, knobs.host_cap_bytes)
        self.set_workers(num_workers)
        journal.write(Kind.LOADER_REBUILT, step, epoch, num_workers=num_workers, cache=self.cache is not None,
                      position=position)
        logger.info(f"data loader rebuilt: {num_workers} workers{', sample cache on' if self.cache else ''}")
        self.detector.restart()
        self._skip_next = True
        return self.batches(epoch, position, 0, step=step)

    def set_workers(self, num_workers: int) -> None:
        """Build the loader anew with `num_workers` (takes effect at the next `batches`)."""
        if not self.owned:
            raise RuntimeError("the DataLoader was built by the caller: its workers are not changed")
        self.num_workers = num_workers
        self.loader = self._build(self._cached if self.cache is not None else self.dataset, num_workers)

    def _start_cache(self, action: CacheSamples, journal: Journal, step: int, epoch: int,
                     host_cap_bytes: int | None) -> None:
        try:
            split = split_for_caching(self.dataset)
        except NotCacheable as exc:
            journal.write(Kind.SAMPLE_CACHE_OFF, step, epoch, reason=str(exc))
            warn(f"not caching samples: {exc}")
            return
        host = device_sample(torch.device("cpu"), host_cap_bytes)
        room = host.cap_bytes - host.used_bytes if host.cap_bytes and host.used_bytes is not None else None
        budget, limit = cache_budget(action.max_bytes, action.available_fraction, room_bytes=room)
        if budget <= 0:
            journal.write(Kind.SAMPLE_CACHE_OFF, step, epoch, reason=f"no room: {limit} is 0")
            warn(f"not caching samples: no room ({limit} is 0)")
            return
        try:
            self.cache = SampleCache(len(split.raw), budget)
        except OSError as exc:  # /dev/shm full (its space is reserved at creation: never SIGBUS later)
            journal.write(Kind.SAMPLE_CACHE_OFF, step, epoch, reason=f"{type(exc).__name__}: {exc}")
            warn(f"not caching samples: the cache's shared memory could not be made ({exc}); the data is read as before")
            return
        weakref.finalize(self, self.cache.close)  # the region goes with the trainer, or at exit
        self._cached = CachedDataset(split, self.cache)
        journal.write(Kind.SAMPLE_CACHE_ON, step, epoch, budget_bytes=budget, limited_by=limit, how=split.how,
                      path=str(self.cache.path), reason=action.reason)
        logger.info(f"caching decoded samples in shared memory (budget {format_bytes(budget)}, set by {limit})")

    def epoch_end(self, journal: Journal, step: int, epoch: int) -> None:
        """Journal the cache's hit rate over the epoch, and start counting afresh."""
        if self.cache is None:
            return
        journal.write(Kind.SAMPLE_CACHE, step, epoch, **self.cache.stats())
        self.cache.reset_counters()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None

