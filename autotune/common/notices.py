"""What a user must know reaches them: warnings on stderr by default, once per cause, rank 0 only.

The library's INFO and DEBUG lines go through loguru, which a library keeps disabled
(`logger.enable("autotune")` shows them; the `autotune` command does). What a user of
`AutoTrainer` or `Tuner` in their own script must not miss (a preemption, an unsafe resume, a
failed checkpoint, a non-finite step, an OOM survived) goes through `warn`, which writes it to
stderr through the standard `logging` logger "autotune", as Hugging Face's and Lightning's
warnings reach their users:

    autotune: stopped by SIGTERM at step 12, checkpoint runs/x/checkpoints/step-000000012.pt; ...

The level is set by the AUTOTUNE_VERBOSITY environment variable ("error", "warning" (the
default), "info", "debug") or by `autotune.set_verbosity(...)`; "error" keeps only errors.
Under torchrun only rank 0 speaks (every rank sees the same causes). Each cause is said once
per process (`key`), however often it comes back.

Owns: what reaches stderr by default, and its verbosity. Touches the `autotune` logging logger only.
"""

from __future__ import annotations

import logging
import os
import sys

from loguru import logger
from tqdm.auto import tqdm

LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}

_said: set[str] = set()
_through_loguru = False  # the CLI shows everything through its loguru sink: no second copy


class _Stderr(logging.StreamHandler):
    """Writes to sys.stderr as it is at each write (a notebook's, a test's capture), not as it
    was when the handler was made."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        stream = self.stream
        if stream is None or getattr(stream, "closed", False):
            # Nowhere to say it (a daemon that closed its stderr, pythonw's None): the run goes on, and
            # the journal has the record. logging's handleError would raise writing to a closed stream.
            return
        # Through tqdm: a progress bar on the same stream is cleared, the line written, the bar drawn again
        # below it (written plainly, the line was glued onto the bar's).
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own rule: a handler never raises
            self.handleError(record)


def _library_logger() -> logging.Logger:
    log = logging.getLogger("autotune")
    if not getattr(log, "_autotune_configured", False):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("autotune: %(message)s"))
        log.addHandler(handler)
        log.propagate = False  # the user's root logger does not print it twice
        log.setLevel(_level_from_environment())
        log._autotune_configured = True  # type: ignore[attr-defined]
    return log


def _level_from_environment() -> int:
    name = os.environ.get("AUTOTUNE_VERBOSITY", "warning").strip().lower()
    if name not in LEVELS:
        print(f"autotune: AUTOTUNE_VERBOSITY={name!r} is not one of {', '.join(LEVELS)}; using 'warning'",
              file=sys.stderr)
        return logging.WARNING
    return LEVELS[name]


def set_verbosity(level: str | int) -> None:
    """How much of autotune's own reporting reaches stderr: "error", "warning" (the default),
    "info" or "debug" (or a `logging` level). Overrides AUTOTUNE_VERBOSITY."""
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise ValueError(f"verbosity must be one of {', '.join(LEVELS)}, got {level!r}")
        level = LEVELS[level.lower()]
    _library_logger().setLevel(level)


def show_through_loguru() -> None:
    """The `autotune` command's own sink shows the library's loguru lines, warnings included:
    `warn` then says nothing of its own."""
    global _through_loguru
    _through_loguru = True


def _rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def warn(message: str, key: str | None = None, error: bool = False, every_rank: bool = False) -> None:
    """Tell the user `message` (at ERROR with `error`), once per `key` (default: the message
    itself) in this process, on rank 0 only (`every_rank`: on this rank, whichever it is: what
    only this rank knows); a repeat goes to the library's loguru log at DEBUG."""
    key = message if key is None else key
    if key in _said:
        logger.debug(message)
        return
    _said.add(key)
    (logger.error if error else logger.warning)(message)  # shown where loguru is enabled for autotune
    if not _through_loguru and (every_rank or _rank_zero()):
        _library_logger().log(logging.ERROR if error else logging.WARNING, message)


def info(message: str) -> None:
    """A line only a user who asked for INFO sees (AUTOTUNE_VERBOSITY=info), rank 0 only."""
    logger.info(message)
    if not _through_loguru and _rank_zero():
        _library_logger().info(message)
