"""What a policy sees: frozen records of the training state and the memory figures.

Policies get a `Snapshot` and nothing else, so they can be tested with a few lines:
build a snapshot, call `decide`, compare the actions.

Owns the records' shapes. Touches nothing.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DeviceSample:
    """One reading of device (or host) memory.

    `used_bytes` is what counts against `cap_bytes`: device memory in use on CUDA; on
    CPU the figure the tightest cap is measured against (virtual size under RLIMIT_AS,
    resident size under a cgroup or a soft cap). `None` means "not available".
    """

    time: float
    used_bytes: int | None = None
    cap_bytes: int | None = None
    total_bytes: int | None = None
    source: str = ""  # what the cap is: "cuda", "rlimit_as", "cgroup", "memory_cap", "host"

    @property
    def used_fraction(self) -> float | None:
        """`used_bytes / cap_bytes`, or None when either is not known."""
        if self.used_bytes is None or not self.cap_bytes:
            return None
        return self.used_bytes / self.cap_bytes


@dataclasses.dataclass(frozen=True)
class AllocatorStats:
    """In-process allocator figures for the last step (CUDA: `torch.cuda.memory_stats`)."""

    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_bytes: int = 0  # highest allocated during the step; reset every step
    reserved_peak_bytes: int = 0  # highest reserved during the step (what the cap binds); reset every step
    num_alloc_retries: int = 0
    num_ooms: int = 0
    inactive_split_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What one step needed: its peak above the memory in use when it began, and the room the cap
    left then, in the measure the cap binds (CUDA allocated bytes; CPU virtual size under
    RLIMIT_AS, else resident size). `exact` False: estimated, not measured (see demand.StepDemand)."""

    micro_batch_size: int | None
    need_bytes: int
    room_bytes: int
    exact: bool = True
    # What the step left in use (in the same measure): code compiled for a new shape, lazily built
    # state. Part of `need_bytes`, but needed once: a later step at the size has it already.
    kept_bytes: int = 0
    # Whether what it kept is the process's heap (CPU, virtual size), which later steps reuse out
    # of sight of the measure: their needs then read low beside this step's.
    kept_is_heap: bool = False


@dataclasses.dataclass(frozen=True, slots=True)  # slots: one is made every batch
class StepTiming:
    """Where the time of the last optimizer step went."""

    step_seconds: float = 0.0  # from asking the loader for the batch to the optimizer step
    data_wait_seconds: float = 0.0  # blocked in the loader's next()
    retries: int = 0  # OOMs survived while doing this batch

    @property
    def data_wait_fraction(self) -> float:
        return self.data_wait_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class InputProfile:
    """Where the time of producing one sample goes: the cacheable part vs what runs after it."""

    load_seconds: float  # per sample: read + decode (the part a cache saves)
    transform_seconds: float  # per sample: what still runs after a cache hit (e.g. random crops)
    samples: int  # how many samples were timed
    cacheable: bool
    how: str  # the rule that split the dataset, or why it cannot be cached

    @property
    def load_share(self) -> float:
        total = self.load_seconds + self.transform_seconds
        return self.load_seconds / total if total > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class InputState:
    """The input pipeline over the recent steps (since the loader was last rebuilt)."""

    data_wait_fraction: float  # time blocked in the loader's next() / step time
    samples_per_second: float
    steps: int  # steps the two figures above are over
    num_workers: int
    cpu_cores: int  # cores this process may run on
    loader_owned: bool  # built by the trainer, so it can be rebuilt (not the caller's DataLoader)
    cache_active: bool = False
    profile: InputProfile | None = None  # measured once, when the loop first looked input-bound
    gathered: bool = False  # a batch is one gather from tensors in memory (data/tensors.py): workers cannot help
    max_workers: int | None = None  # the most workers that can start here (0: /dev/shm has no room); None: no limit


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The training state at the moment an event fires. Policies must treat it as read-only."""

    step: int  # optimizer steps completed in this fit
    epoch: int
    batch_size: int  # samples per optimizer step the user asked for
    micro_batch_size: int  # samples per forward/backward now
    device: str
    keep_effective_batch: bool = True
    failed_micro_batch: int | None = None  # set on OOM: the size that just failed
    last_good_micro_batch: int | None = None  # the micro-batch of the last batch that completed
    # What the last step demanded, as a share of the room it had: (step peak - memory in use
    # when the fit started) / (cap - memory in use when the fit started). Near 1: the step
    # barely fits. None where the step peak cannot be measured.
    step_demand: float | None = None
    step_memory: StepMemory | None = None  # the same in bytes, with the micro-batch it was measured at
    ooms: int = 0  # OOMs survived so far in this fit
    sample: DeviceSample | None = None  # latest memory reading
    window: tuple[DeviceSample, ...] = ()  # recent readings, oldest first
    allocator: AllocatorStats | None = None
    timing: StepTiming | None = None
    input: InputState | None = None
    reliefs: tuple[str, ...] = ()  # memory reliefs in effect, in the order applied: "autocast", "checkpointing", "pruning"
    last_relief_step: int | None = None  # the step the last relief was applied at
    pruned_fraction: float = 0.0  # share of the model's parameters pruning has removed so far
