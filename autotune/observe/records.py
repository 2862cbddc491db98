"""The journal's record kinds and their fields: the one registry.

Every record has `time` (unix seconds), `kind`, `step` and `epoch`; the fields below are the rest.
`Journal.write` refuses a kind that is not here (a writer's typo fails in the suite, not in a
user's report), and with AUTOTUNE_STRICT_JOURNAL=1 (the test suite sets it) a field that is not
either. TensorBoard's text tab shows the kinds marked `shown`; `autotune report` reads the kinds
by these names; the documented list (docs/observability.md) is `markdown()` (tests/observe/test_records.py keeps them equal;
`python -m autotune.observe.records` prints it).

Owns the names; touches nothing.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping


class Kind:
    """The record kinds by name, for writers and readers: `journal.write(Kind.OOM, ...)`,
    `by_kind[Kind.OOM]`. Plain strings (what the journal's lines hold); a misspelt name is an
    AttributeError where it runs, and tests/observe/test_records.py finds every use of one in the package
    and refuses a kind written or read as a bare string."""

    FIT_START = "fit_start"
    OOM = "oom"
    OOM_RETRY = "oom_retry"
    OUT_OF_MEMORY = "out_of_memory"
    ACTION = "action"
    POLICY_ERROR = "policy_error"
    RELIEF = "relief"
    RELIEF_EFFECT = "relief_effect"
    RELIEF_FAILED = "relief_failed"
    RELIEF_DROPPED = "relief_dropped"
    NONFINITE = "nonfinite"
    NUMERICS = "numerics"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_REFUSED = "checkpoint_refused"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    RESUME = "resume"
    WORLD_CHANGED = "world_changed"
    PREEMPTED = "preempted"
    DATA_STALLED = "data_stalled"
    STOP_REQUESTED = "stop_requested"
    EPOCH_END = "epoch_end"
    EVALUATE = "evaluate"
    EVAL_OOM = "eval_oom"
    FIT_END = "fit_end"
    FIT_FAILED = "fit_failed"
    MONITOR_START = "monitor_start"
    MONITOR_RESTART = "monitor_restart"
    MONITOR_GAVE_UP = "monitor_gave_up"
    INPUT_PROFILE = "input_profile"
    LOADER_REBUILT = "loader_rebuilt"
    SAMPLE_CACHE_ON = "sample_cache_on"
    SAMPLE_CACHE_OFF = "sample_cache_off"
    SAMPLE_CACHE = "sample_cache"
    STEP = "step"


@dataclasses.dataclass(frozen=True)
class RecordKind:
    """One kind of journal record: what it says, and its fields (name -> type, as documented)."""

    name: str
    doc: str
    fields: Mapping[str, str]
    shown: bool = False  # a line in TensorBoard's text tab


def _kind(name: str, doc: str, fields: str, shown: bool = False) -> RecordKind:
    # fields: "name:type name:type ..." (types as the docs show them)
    return RecordKind(name, doc, dict(field.split(":", 1) for field in fields.split()), shown)


_FIT_FIELDS = "micro_batch_size:int batch_size:int tuner:bool"
KINDS: dict[str, RecordKind] = {kind.name: kind for kind in (
    _kind(Kind.FIT_START, "a run of steps starts (AutoTrainer.fit, or a Tuner's first batch)",
          f"device:str keep_effective_batch:bool memory_cap:int|None policies:list precision:str "
          f"clip_grad_norm:float|None clip_grad_value:float|None compiled:bool epochs:int max_steps:int|None "
          f"eval_every:int|str|None world:int run_id:str {_FIT_FIELDS}", shown=True),
    _kind(Kind.OOM, "an out-of-memory error survived: the same batch is retried smaller",
          "micro_batch_size:int device:str message:str injected:bool lost_seconds:float ooms:int breakdown:dict|None "
          "memory_snapshot:dict", shown=True),
    _kind(Kind.OOM_RETRY, "a batch's first out-of-memory error on CUDA at the size the last batch completed at, retried "
          "once at that size after a synchronize and an emptied cache (a block that would fit may wait on another "
          "stream); a second OOM goes to the policies", "micro_batch_size:int retries:int", shown=True),
    _kind(Kind.OUT_OF_MEMORY, "an out-of-memory error that could not be survived (raised after a checkpoint)",
          "micro_batch_size:int device:str tried:list memory:str breakdown:dict|None phase:str error:str", shown=True),
    _kind(Kind.ACTION, "a policy's action, applied or not", "event:str policy:str action:str params:dict reason:str "
          "applied:bool note:str"),
    _kind(Kind.POLICY_ERROR, "a policy raised: ignored this time", "policy:str event:str error:str"),
    _kind(Kind.RELIEF, "a memory relief carried out (autocast, checkpointing, pruning)",
          "relief:str demand_before:float|None note:str dtype:str grad_scaler:bool blocks:list channel_ratio:float "
          "parameters_before:int parameters_after:int kept_whole:list parameters_removed_in_all:float", shown=True),
    _kind(Kind.RELIEF_EFFECT, "what the steps demand a few steps after a relief",
          "relief:str applied_at_step:int demand_after:float", shown=True),
    _kind(Kind.RELIEF_FAILED, "a relief that could not be carried out (the model is as it was)", "relief:str reason:str",
          shown=True),
    _kind(Kind.RELIEF_DROPPED, "a relief asked, then not carried out (a smaller micro-batch went first; another "
          "rank's policies decide)", "relief:str reason:str why:str", shown=True),
    _kind(Kind.NONFINITE, "an optimizer step not taken on NaN or inf gradients", "at_step:int error:str action:str"),
    _kind(Kind.NUMERICS, "training computes differently from a whole-batch forward (BatchNorm at a micro-batch below "
          "the batch)", "change:str micro_batch_size:int batch_size:int modules:int", shown=True),
    _kind(Kind.CHECKPOINT, "a checkpoint on disk", "reason:str path:str seconds:float background:bool "
          "write_seconds:float position:int samples_seen:int micro_batch_size:int", shown=True),
    _kind(Kind.CHECKPOINT_FAILED, "a checkpoint that could not be written (retried at the next due time)",
          "reason:str error:str path:str in_a_row:int", shown=True),
    _kind(Kind.CHECKPOINT_REFUSED, "a checkpoint not written: the weights are not finite (the older ones are kept)",
          "reason:str nonfinite:list"),
    _kind(Kind.CHECKPOINT_SKIPPED, "HF's checkpoint before an OOM error skipped: its save would not fit",
          "reason:str need_bytes:int room_bytes:int|None"),
    _kind(Kind.RESUME, "a resume: from which checkpoint, or none found", "found:bool path:str position:int "
          "samples_seen:int micro_batch_size:int run_id:str|None", shown=True),
    _kind(Kind.WORLD_CHANGED, "resumed on another number of ranks: each rank's batch re-split so the job's stays",
          "from_world:int to_world:int batch_size_from:int batch_size_to:int global_batch:int position:int "
          "micro_batch_size:int", shown=True),
    _kind(Kind.PREEMPTED, "stopped by a signal, after a checkpoint", "signal:str checkpoint:str", shown=True),
    _kind(Kind.DATA_STALLED, "the wait for a batch passed the stall threshold (stall.py): which batch, which samples",
          "seconds:float threshold:float position:int batch:int indices:list", shown=True),
    _kind(Kind.STOP_REQUESTED, "a callback (or another rank's) asked to stop", "reason:str"),
    _kind(Kind.EPOCH_END, "an epoch done", "samples_seen:int loss:float|None micro_batch_size:int"),
    _kind(Kind.EVALUATE, "an evaluation", "metrics:dict samples:int micro_batch_size:int ooms:int seconds:float"),
    _kind(Kind.EVAL_OOM, "an out-of-memory error in evaluation: the same samples again, smaller",
          "micro_batch_size:int message:str"),
    _kind(Kind.FIT_END, "a run of steps ended", f"samples_seen:int ooms:int nonfinite_steps:int wall_seconds:float "
          f"loss:float|None "
          f"metrics:dict stopped:str|None compiles:int {_FIT_FIELDS}", shown=True),
    _kind(Kind.FIT_FAILED, "a run ended by an error (the checkpoint it left, the sample that failed to load, if any)",
          "error:str samples_seen:int checkpoint:str bad_sample:dict", shown=True),
    _kind(Kind.MONITOR_START, "the memory monitor process started (`board`: its shared sample board, "
          "in /dev/shm or, where that has no room, in the run folder)", "pid:int interval:float board:str"),
    _kind(Kind.MONITOR_RESTART, "the monitor process exited and was restarted", "returncode:int|None restarts:int "
          "pid:int|None", shown=True),
    _kind(Kind.MONITOR_GAVE_UP, "the monitor process exited too often: training goes on without it",
          "returncode:int|None restarts:int pid:int|None", shown=True),
    _kind(Kind.INPUT_PROFILE, "the loop waits on its data: where the time of a sample goes",
          "samples:int load_ms:float transform_ms:float load_share:float cacheable:bool how:str verdict:str"),
    _kind(Kind.LOADER_REBUILT, "the DataLoader rebuilt at this position (workers or the cache changed; with "
          "`asked_workers` and `reason`: that many workers could not start, /dev/shm full, and it loads in-process "
          "for the rest of the run)", "num_workers:int cache:bool position:int asked_workers:int reason:str", shown=True),
    _kind(Kind.SAMPLE_CACHE_ON, "decoded samples cached in shared memory from here",
          "budget_bytes:int limited_by:str how:str path:str reason:str", shown=True),
    _kind(Kind.SAMPLE_CACHE_OFF, "the sample cache could not start, or stopped", "reason:str", shown=True),
    _kind(Kind.SAMPLE_CACHE, "the sample cache over an epoch (`no_room`: its filling stopped short of the budget, "
          "as /dev/shm had no room)", "hits:int misses:int hit_rate:float|None entries:int "
          "samples:int bytes:int budget_bytes:int full:bool no_room:bool"),
    _kind(Kind.STEP, "steps.jsonl: one step's figures (thinned over a long run)",
          "micro_batch_size:int samples:int samples_seen:int step_seconds:float data_wait_fraction:float "
          "demand:float|None allocated_bytes:int|None reserved_bytes:int|None grad_norm:float"),
)}

COMMON_FIELDS = ("time", "kind", "step", "epoch")


def check(kind: str, fields: Mapping[str, object], strict: bool) -> None:
    """A ValueError naming the kind (and, `strict`, the fields) a writer got wrong."""
    known = KINDS.get(kind)
    if known is None:
        raise ValueError(f"journal record kind {kind!r} is not in autotune/observe/records.py's registry")
    if strict:
        unknown = [name for name in fields if name not in known.fields]
        if unknown:
            raise ValueError(f"journal record {kind!r} has fields {unknown} that records.py does not list")


class RecordsByKind(dict):
    """Journal records grouped by kind, for a reader, the newest `keep` of each (None: all): a kind
    with no record reads as [], a kind the registry does not have is a KeyError naming it (a
    reader's typo would read as no records)."""

    def __init__(self, keep: int | None = None):
        super().__init__()
        self.keep = keep

    def __missing__(self, kind: str) -> list:
        if kind not in KINDS:
            raise KeyError(f"journal record kind {kind!r} is not in autotune/observe/records.py's registry")
        return []

    def add(self, record: Mapping[str, object]) -> None:
        kind = str(record.get("kind", "?"))
        kept = self.get(kind)
        if kept is None:  # not setdefault: a deque made for every record costs a long journal seconds
            kept = self[kind] = collections.deque(maxlen=self.keep)
        kept.append(record)


def markdown() -> str:
    """The documented list of the kinds (docs/observability.md's)."""
    lines = []
    for kind in KINDS.values():
        fields = ", ".join(f"`{name}`" for name in kind.fields)
        lines.append(f"- `{kind.name}`: {kind.doc}. {fields}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
