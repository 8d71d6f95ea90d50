"""Where the pool keeps its files (replica logs, the request log): a directory
of its own, for this user only. `server.state_dir` names a place for it, which
may be shared (say a 1777 directory): the pool makes `llm-pool` in it and
never changes the mode of a directory it did not create."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("llm_pool.state_dir")

POOL_DIR_NAME = "llm-pool"


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / POOL_DIR_NAME


def pool_state_dir(state_dir: str | None) -> Path:
    """The pool's own directory: `llm-pool` in `state_dir`, else in the user's state dir."""
    return Path(state_dir) / POOL_DIR_NAME if state_dir else default_state_dir()


def make_private_dir(path: Path) -> Path:
    """Create `path` and its missing parents, each 0700 (as the XDG base directory
    rule asks); what exists already is left as it is, with a warning when others
    may enter the pool's own directory."""
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        at = at.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)  # the umask can only take bits away
        except FileExistsError:  # made meanwhile by someone else: theirs, not chmod-ed
            pass
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        log.warning("%s is open to other users (mode %o, owner uid %d): the request log and replica logs "
                    "there may be read by them", path, info.st_mode & 0o777, info.st_uid)
    return path
