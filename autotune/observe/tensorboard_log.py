"""TensorBoard scalars and text for a run: `AutoTrainer(..., tensorboard=True)` writes `run_dir/tb`.

Scalars, against the optimizer step: `train/loss`, `train/samples_per_second`,
`train/micro_batch_size`, `train/data_wait_fraction`, `memory/used_gib`, `memory/cap_gib`,
`memory/allocated_gib` and `memory/reserved_gib` (CUDA allocator), `memory/step_demand`,
`autotune/ooms` (running count), `train/epoch_loss`, `input/sample_cache_hit_rate`. Text: `autotune/events`, one markdown line per OOM, applied
policy action, relief, checkpoint and stop, with the reason the journal gives.

It is written at the moments `steps.jsonl` is (every step for the first 200, then at most
once a second), so a two-day run stays small and the loss is read off the device only then.
Needs the optional `tensorboard` package: `pip install 'autotune[tensorboard]'`.

Owns: `run_dir/tb`. Touches nothing of training.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from autotune.common.units import format_bytes
from autotune.observe.records import COMMON_FIELDS, KINDS, Kind

_GIB = 2**30

# Journal kinds worth a line in TensorBoard's text tab (records.py marks them; actions only when applied).
_TEXT_KINDS = {kind.name for kind in KINDS.values() if kind.shown}


def describe(record: dict[str, Any]) -> str | None:
    """One line for a journal record, or None when it is not worth one."""
    kind = record.get("kind")
    if kind == Kind.ACTION:
        if not record.get("applied"):
            return None
        return f"{record.get('policy')}: {record.get('action')} {record.get('params')} - {record.get('reason')}"
    if kind not in _TEXT_KINDS:
        return None
    if kind == Kind.OOM:
        return f"OOM at micro-batch {record.get('micro_batch_size')}: {str(record.get('message', ''))[:160]}"
    if kind == Kind.CHECKPOINT:
        return f"checkpoint ({record.get('reason')}): {record.get('path')}"
    if kind == Kind.FIT_START:
        cap = record.get("memory_cap")
        return (f"fit on {record.get('device')}: batch {record.get('batch_size')}, micro-batch "
                f"{record.get('micro_batch_size')}, cap {format_bytes(cap) if cap else 'none'}, "
                f"policies {', '.join(record.get('policies') or [])}")
    details = ", ".join(f"{k}={v}" for k, v in record.items() if k not in COMMON_FIELDS)
    return f"{kind}: {details}"[:300]


class TensorBoardLog:
    """Writes a run's figures to TensorBoard. Raises ImportError, saying what to install,
    when the `tensorboard` package is missing."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("tensorboard=True needs the tensorboard package: "
                              "pip install 'autotune[tensorboard]' (or pip install tensorboard)") from exc
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self._last: tuple[int, float] | None = None  # (samples seen, monotonic time) at the last step written
        self._pending_step: int | None = None
        self._pending: list[str] = []

    def step(self, step: int, *, loss: float | None, samples_seen: int, step_samples: int, step_seconds: float,
             micro_batch_size: int, data_wait_fraction: float, used_bytes: int | None, cap_bytes: int | None,
             allocated_bytes: int | None, reserved_bytes: int | None, demand: float | None,
             grad_norm: float | None = None) -> None:
        """The figures of one completed optimizer step (`grad_norm`: before clipping)."""
        now = time.monotonic()
        if self._last is not None and now > self._last[1] and samples_seen > self._last[0]:
            rate = (samples_seen - self._last[0]) / (now - self._last[1])  # since the last point: data waits included
        else:
            rate = step_samples / step_seconds if step_seconds > 0 else None
        self._last = (samples_seen, now)
        add = self._writer.add_scalar
        for tag, value in (("train/loss", loss), ("train/samples_per_second", rate),
                           ("train/micro_batch_size", micro_batch_size),
                           ("train/data_wait_fraction", data_wait_fraction),
                           ("memory/used_gib", None if used_bytes is None else used_bytes / _GIB),
                           ("memory/cap_gib", None if cap_bytes is None else cap_bytes / _GIB),
                           ("memory/allocated_gib", None if allocated_bytes is None else allocated_bytes / _GIB),
                           ("memory/reserved_gib", None if reserved_bytes is None else reserved_bytes / _GIB),
                           ("memory/step_demand", demand), ("train/grad_norm", grad_norm)):
            if value is not None:
                add(tag, value, step)

    def record(self, record: dict[str, Any]) -> None:
        """A journal record (the Journal calls this for every line it writes)."""
        kind, step = record.get("kind"), int(record.get("step", 0))
        if kind == Kind.OOM and isinstance(record.get("ooms"), int):
            # The trainer's running count: a resumed run goes on from the checkpoint's.
            self._writer.add_scalar("autotune/ooms", record["ooms"], step)
        elif kind == Kind.EPOCH_END and isinstance(record.get("loss"), (int, float)):
            self._writer.add_scalar("train/epoch_loss", record["loss"], step)
        elif kind == Kind.EVALUATE and isinstance(record.get("metrics"), dict):
            for name, value in record["metrics"].items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(f"eval/{name}", value, step)
        elif kind == Kind.SAMPLE_CACHE and isinstance(record.get("hit_rate"), (int, float)):
            self._writer.add_scalar("input/sample_cache_hit_rate", record["hit_rate"], step)
        line = describe(record)
        if line is None:
            return
        # Lines of one step go out as one text entry: TensorBoard shows one entry per step.
        if self._pending_step is not None and step != self._pending_step:
            self._flush_text()
        self._pending_step = step
        self._pending.append(line)

    def _flush_text(self) -> None:
        if self._pending:
            # Markdown: a list, with the record's own words escaped from emphasis.
            text = "\n".join(f"- {line.replace('_', chr(92) + '_')}" for line in self._pending)
            self._writer.add_text("autotune/events", text, self._pending_step or 0)
        self._pending = []
        self._pending_step = None

    def flush(self) -> None:
        """Everything so far to disk (the end of each fit)."""
        self._flush_text()
        self._writer.flush()

    def close(self) -> None:
        self.flush()
        self._writer.close()
