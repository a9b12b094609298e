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
- **No write, rename or delete through a link.** ``run_folder`` refuses a run folder, or the
  --checkpoint-dir above it, that is a symlink, is not a folder, or resolves anywhere but the
  checkpoint folder's own child; ``own_entry`` refuses a symlink (or a non-folder) where a folder of
  the project's goes inside it (``step_N``, ``.tmp-step_N``, ``.old-step_N``). Every save, commit,
  prune, lock and resume calls them at the moment of use, and ``check_run_folder`` calls both before
  any process starts. ``owned`` tells whether a folder is a complete checkpoint this project wrote
  (its manifest, and exactly the files it lists): retention deletes nothing else.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import stat
import time

LOCK = ".lock"
FORMAT = "parallel-twins-checkpoint/1"
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 24  # a manifest lists a few files: kilobytes
STEP = re.compile(r"^step_(\d{6,})$")
OWN = re.compile(r"^(step_|\.tmp-step_|\.old-step_)\d{6,}$")  # the folders a run folder holds: ours by name
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


def _link_line(path: str, what: str) -> CheckpointError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return CheckpointError(f"{path}: {what} is a symlink{target}: nothing is written, read or deleted through a "
                           "link; give the real folder (or remove the link)")


def checkpoint_dir(path: str) -> None:
    """--checkpoint-dir itself: absent or a real folder, never a symlink (CheckpointError, one line)."""
    path = os.path.normpath(path)
    if os.path.islink(path):
        raise _link_line(path, "the checkpoint folder")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: the checkpoint folder is a file, not a folder: refused")


def run_folder(run_dir: str, create: bool = False) -> str:
    """``run_dir`` (``<--checkpoint-dir>/<run name>``), checked to be a real folder of its own:
    neither it nor the checkpoint folder above it a symlink or a file, and, resolved, the checkpoint
    folder's own child (no link on the way moved it). ``create``: made when absent (checked again
    after). CheckpointError (one line) otherwise. Returns ``run_dir``."""
    run_dir = os.path.normpath(run_dir)
    top = os.path.dirname(os.path.abspath(run_dir))
    checkpoint_dir(top)
    if os.path.islink(run_dir):
        raise _link_line(run_dir, "the run's checkpoint folder")
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise CheckpointError(f"{run_dir}: the run's checkpoint folder is a file, not a folder: refused")
    if create and not os.path.lexists(run_dir):
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{run_dir}: cannot create the run's checkpoint folder ({exc.strerror or exc})") \
                from None
        return run_folder(run_dir)
    if os.path.lexists(run_dir) and os.path.realpath(run_dir) != os.path.join(os.path.realpath(top),
                                                                             os.path.basename(run_dir)):
        raise CheckpointError(f"{run_dir}: resolves to {os.path.realpath(run_dir)}, outside its checkpoint folder: "
                              "refused")
    return run_dir


def own_entry(run_dir: str, name: str) -> str:
    """``run_dir/name`` for a folder of the project's (``step_N``, ``.tmp-step_N``, ``.old-step_N``):
    absent, or a real folder (never a symlink or a file). CheckpointError (one line) otherwise."""
    path = os.path.join(run_dir, name)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    if stat.S_ISLNK(mode):
        raise _link_line(path, "a checkpoint's folder")
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: {_kind(mode)} where a checkpoint's folder goes: remove it (nothing was "
                              "written or deleted)")
    return path


def check_run_folder(run_dir: str) -> None:
    """Before any process starts: the run folder and every folder of the project's in it (by name:
    ``step_N``, ``.tmp-step_N``, ``.old-step_N``, and ``.lock``) real, none a symlink."""
    run_folder(run_dir)
    if not os.path.isdir(run_dir):
        return
    for name in sorted(os.listdir(run_dir)):
        if OWN.match(name):
            own_entry(run_dir, name)
        elif name == LOCK and os.path.islink(os.path.join(run_dir, name)):
            raise _link_line(os.path.join(run_dir, name), "the run's lock")


def owned(path: str) -> bool:
    """Whether ``path`` is a complete checkpoint this project wrote: a real folder (not a link) named
    ``step_N``, its manifest of this project's format and step N, and exactly the files the manifest
    lists, each a regular file of its size (no link, FIFO or device anywhere). Nothing is hashed:
    this decides what retention may delete, never what is loaded (``verify`` does that)."""
    try:
        m = STEP.match(os.path.basename(path))
        if not m or not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        fd, size = open_confined(path, MANIFEST)
        with os.fdopen(fd, "rb") as f:
            info = json.loads(f.read(MAX_MANIFEST_BYTES)) if size <= MAX_MANIFEST_BYTES else None
        files = info.get("files") if isinstance(info, dict) else None
        if not isinstance(files, dict) or info.get("format") != FORMAT or info.get("step") != int(m.group(1)):
            return False
        if set(walk_files(path)) != set(files) | {MANIFEST}:
            return False
        return all(isinstance(meta, dict) and os.lstat(os.path.join(path, name)).st_size == meta.get("bytes")
                   for name, meta in files.items())
    except (OSError, ValueError, RecursionError):  # CheckpointError is a ValueError: not provably ours
        return False


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 200).decode(errors="replace").strip()
    return text or "a process that has not yet written its pid"


# compare.py takes every run folder's lock before any process starts (hold_locks) and keeps them until it
# exits, so a second writer is refused up front; its runs (JAX in the same process, torch ranks it launched)
# then find the lock held by their own invocation: this names its pid.
HELD_ENV = "PARALLEL_TWINS_LOCKS_HELD_BY"


def _held_by_my_invocation(run_dir: str) -> bool:
    """Whether compare.py, this process or the launcher of this rank, holds ``run_dir``'s lock (HELD_ENV names
    that pid, and the lock file says so)."""
    holder = os.environ.get(HELD_ENV)
    if not holder or holder not in (str(os.getpid()), os.environ.get("PARALLEL_TWINS_LAUNCHER_PID")):
        return False
    try:
        fd = os.open(os.path.join(run_dir, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return _holder(fd).startswith(f"pid {holder} ")
    finally:
        os.close(fd)


def hold_locks(run_dirs) -> list:
    """Take every run folder's lock for this process (compare.py, before any rank or device starts) and name
    it for the runs it launches (HELD_ENV); the locks stay until the process ends. CheckpointError, one line
    naming the holder, when another process writes one of them."""
    held = []
    try:
        for d in dict.fromkeys(run_dirs):
            held.append(RunLock(d).__enter__())
    except CheckpointError:
        for lock in held:
            lock.__exit__()
        raise
    _HELD.extend(held)
    os.environ[HELD_ENV] = str(os.getpid())
    return held


_HELD: list = []  # hold_locks' locks, until release_locks (compare.py's end) or the process's


def release_locks() -> None:
    """Drop every lock hold_locks took (compare.py, as it returns)."""
    while _HELD:
        _HELD.pop().__exit__()
    if os.environ.get(HELD_ENV) == str(os.getpid()):
        del os.environ[HELD_ENV]


class RunLock:
    """``with RunLock(run_dir):`` — this process is the one writer of ``run_dir`` (created if absent)
    until the block ends or the process dies. CheckpointError (one line: the folder, the holder) when
    another process holds it, or the folder cannot be created or locked. A lock this run's own compare.py
    already holds (hold_locks) is its own: nothing more is taken."""

    def __init__(self, run_dir: str):
        self.run_dir, self.fd = run_dir, None

    def __enter__(self) -> RunLock:
        run_folder(self.run_dir, create=True)  # never through a link: refused before anything is created
        if _held_by_my_invocation(self.run_dir):
            return self
        try:
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
    path = os.path.join(run_folder(run_dir), LOCK)
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
