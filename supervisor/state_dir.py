"""Where the pool keeps its files (replica logs, the request log, saved KV): a
directory of its own, for this user only, and for one pool at a time.
`server.state_dir` names a place for it, which may be shared (say a 1777
directory): the pool makes `llm-pool` in it and never changes the mode of a
directory it did not create. A pool directory that another user owns, or that
others may write, is refused: what the pool deletes and reads back there must be
what it wrote (issue 53). The `lock` file in it says which pool holds it."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

log = logging.getLogger("llm_pool.state_dir")

POOL_DIR_NAME = "llm-pool"
LOCK_NAME = "lock"


class StateDirRefused(Exception):
    """The state directory cannot be the pool's: owned by another user, writable by others,
    or held by another pool. The message says which and what to do."""


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / POOL_DIR_NAME


def pool_state_dir(state_dir: str | None) -> Path:
    """The pool's own directory: `llm-pool` in `state_dir`, else in the user's state dir."""
    return Path(state_dir) / POOL_DIR_NAME if state_dir else default_state_dir()


def make_private_dir(path: Path) -> Path:
    """Create `path` and its missing parents, each 0700 (as the XDG base directory
    rule asks); what exists already is left as it is. `path` itself must be this
    user's and writable by no one else (StateDirRefused), a symlink too (both the link
    and what it names); readable by others is warned of."""
    missing = []
    at = path
    while not os.path.lexists(at):
        missing.append(at)
        at = at.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)  # the umask can only take bits away
        except FileExistsError:  # made meanwhile by someone else: checked below
            pass
    link = path.lstat()
    info = path.stat()
    uid = os.getuid()
    if link.st_uid != uid or info.st_uid != uid:
        raise StateDirRefused(f"{path} belongs to another user (uid {info.st_uid if info.st_uid != uid else link.st_uid}"
                              f"): the pool keeps its logs and saved KV only in a directory of its own user's; "
                              f"remove it or set server.state_dir elsewhere")
    if not stat.S_ISDIR(info.st_mode):
        raise StateDirRefused(f"{path} is not a directory")
    if info.st_mode & 0o022:
        raise StateDirRefused(f"{path} is writable by other users (mode {info.st_mode & 0o777:o}): what the pool "
                              f"reads back and deletes there could be theirs; chmod go-w it")
    if info.st_mode & 0o055:
        log.warning("%s is open to other users (mode %o): the request log and replica logs there may be read by "
                    "them", path, info.st_mode & 0o777)
    return path


class StateDirLock:
    """One pool per state directory: an exclusive flock on `lock` in it, held while the
    process lives (the kernel lets it go however the process ends). The file names the holder,
    so that a second pool can say who holds it."""

    def __init__(self, path: Path) -> None:
        self.path = path / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> StateDirLock:
        # O_NOFOLLOW: a link planted in the pool's own directory is refused, not followed;
        # O_CLOEXEC: no runtime the pool starts holds the lock after it
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StateDirRefused(f"{self.path.parent} is in use by another pool ({holder}): two pools cannot share "
                                  "a state directory; stop that one or set server.state_dir elsewhere") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with it
            self.fd = None


def claim_state_dir(state_dir: str | None) -> StateDirLock:
    """The pool's directory made and checked (make_private_dir), and locked for this process."""
    return StateDirLock(make_private_dir(pool_state_dir(state_dir))).acquire()
