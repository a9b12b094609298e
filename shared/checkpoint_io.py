"""Checkpoint folders on disk, guarded (stdlib only; shared.checkpoint builds on it).

- **Confinement.** A manifest names its files relative to its checkpoint folder. ``open_confined``
  refuses a name that is absolute, empty or holds ``..``; a symlink anywhere on the way (the file
  or a folder below the checkpoint folder); anything but a regular file. It opens without following
  links (O_NOFOLLOW), compares the opened file with what was checked, and hands back its size from
  ``fstat``, so sizes are checked before a byte is hashed and a file outside the folder is never
  opened, measured or named with its size.
- **One writer per run folder.** ``RunLock`` holds ``fcntl.flock`` on ``<run folder>/.lock`` while a
  run writes there; the file names the holder (pid, host, since when). A second writer is refused
  in one line naming the folder and the holder. The lock dies with its process (the kernel drops
  it), so a killed run never leaves a stale lock.
- **Save-time failures** (read-only folder, full disk) become one ``CheckpointError`` line naming
  the run folder and the step; the caller removes its half-written ``.tmp-`` folder, and earlier
  checkpoints are not touched.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time

LOCK = ".lock"
GROUPS = ("params", "adam_m", "adam_v")  # the canonical state's three dicts, as named in the files


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or saved: one line naming the file and the mismatch."""


def entry_parts(folder: str, name) -> list[str]:
    """The components of a manifest entry ``name``: a relative path of plain names (no ``..``,
    ``.``, empty parts, absolute paths or backslashes); CheckpointError otherwise."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name or "\0" in name:
        raise CheckpointError(f"{os.path.join(folder, 'manifest.json')}: entry {name!r} is not a relative file "
                              "name inside the checkpoint folder")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"{os.path.join(folder, 'manifest.json')}: entry {name!r} leaves or bends the "
                              "checkpoint folder ('..', '.', or an empty part): refused")
    return parts


def _kind(mode: int) -> str:
    return "a symlink" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"


def open_confined(folder: str, name) -> tuple[int, int]:
    """(fd, size) of the regular file ``name`` inside ``folder``, opened read-only without following
    any link. Refused (CheckpointError) before anything is opened when the name, a folder on the
    way, or the file itself is not plain."""
    parts = entry_parts(folder, name)
    here = folder
    for part in parts[:-1]:
        here = os.path.join(here, part)
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            raise CheckpointError(f"{os.path.join(folder, name)}: missing (the manifest lists it)") from None
        if not stat.S_ISDIR(mode):
            raise CheckpointError(f"{here}: {_kind(mode)} where the checkpoint needs a folder: refused")
    path = os.path.join(here, parts[-1])
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the manifest lists it)") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: {_kind(st.st_mode)}, not a regular file of the checkpoint: refused")
    real, top = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, top]) != top:  # cannot happen after the checks above; stated anyway
        raise CheckpointError(f"{path}: resolves outside the checkpoint folder: refused")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    got = os.fstat(fd)
    if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(got.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: changed while it was checked: refused")
    return fd, got.st_size


def walk_files(folder: str) -> list[str]:
    """Every file below ``folder`` as a relative name, sorted; a symlink, FIFO, socket or device
    anywhere below it is refused (a checkpoint holds only folders and regular files)."""
    out = []

    def visit(here: str, rel: str) -> None:
        with os.scandir(here) as entries:
            for e in entries:
                name = f"{rel}/{e.name}" if rel else e.name
                if e.is_symlink():
                    raise CheckpointError(f"{e.path}: a symlink inside a checkpoint: refused")
                if e.is_dir(follow_symlinks=False):
                    visit(e.path, name)
                elif e.is_file(follow_symlinks=False):
                    out.append(name)
                else:
                    raise CheckpointError(f"{e.path}: not a regular file or folder, inside a checkpoint: refused")

    visit(folder, "")
    return sorted(out)


def save_error(run_dir: str, step: int, exc: BaseException) -> CheckpointError:
    """One line for a save that failed (read-only folder, full disk, …): the run folder, the step,
    the system's reason; earlier checkpoints are kept."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip().splitlines()[0] \
        if str(exc).strip() else type(exc).__name__
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        reason = "no space left on the device"
    return CheckpointError(f"{run_dir}: cannot save step {step}: {reason} (the earlier checkpoints are kept)")


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 200).decode(errors="replace").strip()
    return text or "a process that has not yet written its pid"


class RunLock:
    """``with RunLock(run_dir):`` — this process is the one writer of ``run_dir`` (created if absent)
    until the block ends or the process dies. CheckpointError (one line: the folder, the holder) when
    another process holds it, or the folder cannot be created or locked."""

    def __init__(self, run_dir: str):
        self.run_dir, self.fd = run_dir, None

    def __enter__(self) -> RunLock:
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            fd = os.open(os.path.join(self.run_dir, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644)
        except OSError as exc:
            what = "a symlink" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
            raise CheckpointError(f"{self.run_dir}: cannot lock the run's checkpoint folder ({LOCK}: {what})") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointError(f"{self.run_dir}: another run is writing this checkpoint folder ({holder}): "
                                  "wait for it to end, or give another --checkpoint-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                     f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # no holder named once released
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def lock_holder(run_dir: str) -> str | None:
    """Who holds ``run_dir``'s lock now (its line), or None: for a check before any process starts
    (the run itself takes the lock; this only looks)."""
    path = os.path.join(run_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise CheckpointError(f"{path}: cannot read the lock ({why})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)
    return None
