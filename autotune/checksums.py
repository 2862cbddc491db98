"""Checkpoint files checked before they are read: a sha256 written beside each one and compared on
load, so a file that changed on disk since it was written (a flipped bit) is never trained from.

    write_beside(file, final)   a checkpoint file's digest into `final.sha256`, before `file` (its
                                temporary) is renamed to `final`: a checkpoint in place has its sum
    write_manifest(folder)      a sharded checkpoint's files' digests into `folder/SHA256SUMS`,
                                before the folder is renamed into place
    verify(path)                `ChecksumMismatch` naming the file whose digest differs; a
                                checkpoint without sums (an older autotune's) is read as it is

Owns the `.sha256` files and `SHA256SUMS`. Touches nothing else.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SUFFIX = ".sha256"
MANIFEST = "SHA256SUMS"


class ChecksumMismatch(ValueError):
    """A checkpoint file's sha256 is not the one written with it."""


def digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def beside(path: Path) -> Path:
    """Where a checkpoint file's sum is kept."""
    return path.with_name(path.name + SUFFIX)


def _write(text: str, final: Path) -> None:
    temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, final)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_beside(file: Path, final: Path) -> None:
    """The digest of `file` (the written temporary of `final`) into `final`'s sum file."""
    _write(f"{digest(file)}  {final.name}\n", beside(final))


def write_manifest(folder: Path) -> None:
    """Every file of a sharded checkpoint's `folder`, with its digest, into its manifest."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    _write("".join(f"{digest(p)}  {p.name}\n" for p in files), folder / MANIFEST)


def _read_sums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        value, _, name = line.partition("  ")
        if name:
            sums[name] = value
    return sums


def verify(path: Path) -> None:
    """Raise `ChecksumMismatch` naming the file of checkpoint `path` (a file, or a sharded folder)
    whose digest is not the one written with it, or that is missing."""
    sums_file = path / MANIFEST if path.is_dir() else beside(path)
    if not sums_file.exists():
        return  # written before checksums (or by a process killed between the two renames)
    sums = _read_sums(sums_file.read_text())
    for name, expected in sums.items():
        file = path / name if path.is_dir() else path
        if not file.exists():
            raise ChecksumMismatch(f"{file} is missing (listed in {sums_file})")
        if digest(file) != expected:
            raise ChecksumMismatch(f"{file} is not the file written there: its sha256 differs from the one in "
                                   f"{sums_file} (changed on disk since: a flipped bit, a partial copy)")
