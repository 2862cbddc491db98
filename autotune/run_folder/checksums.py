"""Checkpoint files checked before they are read: a sha256 written beside each one and compared on
load, so a file that changed on disk since it was written (a flipped bit) is never trained from.

    write_beside(file, final)   a checkpoint file's digest into `final.sha256`, before `file` (its
                                temporary) is renamed to `final`: a checkpoint in place has its sum
    write_manifest(folder)      a sharded checkpoint's files' digests into `folder/SHA256SUMS`,
                                before the folder is renamed into place
    verify(path)                `ChecksumMismatch` naming the file whose digest differs, or a sum
                                file that holds no digest; False where there is no sum file
    unsummed(path, run_id)      for a checkpoint read without a sum: one that names a run (every
                                autotune that writes run ids writes sums) is `ChecksumMismatch`
                                (a copy that left its `.sha256` behind); an older autotune's is read
                                with a word

Owns the `.sha256` files and `SHA256SUMS`. Touches nothing else.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

from autotune.common.files import NotAFile, open_regular
from autotune.common.notices import warn

SUFFIX = ".sha256"
MANIFEST = "SHA256SUMS"


class ChecksumMismatch(ValueError):
    """A checkpoint file's sha256 is not the one written with it."""


def digest(path: Path) -> str:
    """The sha256 of file `path`; `NotAFile` (a ValueError) where it is not a regular file."""
    f = open_regular(path)
    if f is None:
        raise FileNotFoundError(f"{path}: no such file")
    with f:
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


_HEX = frozenset("0123456789abcdef")
_MAX_SUMS_BYTES = 1 << 20  # a manifest of thousands of shards; more is not a sum file


def _read_sums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        value, _, name = line.partition("  ")
        value = value.lower()  # as sha256sum -c reads it
        if name and len(value) == 64 and set(value) <= _HEX:
            sums[name] = value
    return sums


def verify(path: Path) -> bool:
    """Raise `ChecksumMismatch` naming the file of checkpoint `path` (a file, or a sharded folder)
    whose digest is not the one written with it, that is missing, or (a folder) that its manifest
    does not list; or naming a sum file that holds no digest. True once checked; False where there
    is no sum file (see `unsummed`)."""
    sums_file = path / MANIFEST if path.is_dir() else beside(path)
    if not sums_file.exists():
        return False
    try:
        with open_regular(sums_file) or io.BytesIO() as f:  # (gone since: read as empty)
            sums = _read_sums(f.read(_MAX_SUMS_BYTES).decode(errors="replace"))
    except (OSError, NotAFile) as exc:
        raise ChecksumMismatch(f"{sums_file} cannot be read ({exc}): {path} is not checked, so not trusted") from None
    if not sums:
        raise ChecksumMismatch(f"{sums_file} holds no sha256 digest (emptied or damaged): {path} is not checked, so "
                               "not trusted")
    if path.is_dir():
        unlisted = sorted(p.name for p in path.iterdir() if p.name != MANIFEST and p.name not in sums)
        if unlisted:
            raise ChecksumMismatch(f"{path / unlisted[0]} is not listed in {sums_file} (put there since the checkpoint "
                                   "was written)")
    elif len(sums) != 1:
        raise ChecksumMismatch(f"{sums_file} holds {len(sums)} digests where a checkpoint file's has one")
    elif next(iter(sums)) != path.name:  # renamed with its sum: another step's file under this step's name
        raise ChecksumMismatch(f"{path} is not the file its sum was written for ({sums_file} names "
                               f"{next(iter(sums))}): renamed since, so not trusted as this step's")
    for name, expected in sums.items():
        file = path / name if path.is_dir() else path
        if not file.exists():
            raise ChecksumMismatch(f"{file} is missing (listed in {sums_file})")
        try:
            actual = digest(file)
        except NotAFile as exc:
            raise ChecksumMismatch(str(exc)) from None
        if actual != expected:
            raise ChecksumMismatch(f"{file} is not the file written there: its sha256 differs from the one in "
                                   f"{sums_file} (changed on disk since: a flipped bit, a partial copy)")
    return True


def unsummed(path: Path, run_id: str | None) -> None:
    """For checkpoint `path`, read without a sum file: `ChecksumMismatch` where it names a run
    (`run_id`; autotunes that write run ids write sums, so its sum was lost: a copy that left the
    `.sha256` behind, or a deletion); an older autotune's is read as it is, said once."""
    sums_file = path / MANIFEST if path.is_dir() else beside(path)
    if run_id is not None:
        raise ChecksumMismatch(
            f"{path} has no {sums_file.name} beside it, though the autotune that wrote it (run {run_id}) writes one: "
            f"it cannot be checked, so it is not trusted. If the file is intact (copied without its sum), copy "
            f"{sums_file.name} with it")
    warn(f"checkpoint {path} has no checksum (an older autotune's): read without a check", key=f"unsummed {path}")
