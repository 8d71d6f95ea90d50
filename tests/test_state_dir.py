"""A state directory no one else can steer (issue 53): the pool refuses a directory of its own
that another user owns or others may write, and two pools cannot share one (the second says
which pool holds it). Each case is a real `llm-pool serve` process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from supervisor.state_dir import LOCK_NAME, POOL_DIR_NAME, StateDirRefused, claim_state_dir
from tests.conftest import synthetic
from tests.pool import ROOT, Pool

START_S = 60  # a refused start exits at once; on a busy machine Python's imports alone take seconds


def serve_exits(pool: Pool) -> tuple[int, str]:
    """Run `llm-pool serve` on the pool's config to its exit: (exit code, its output)."""
    done = subprocess.run(pool.command, cwd=ROOT, env=pool.env, capture_output=True, text=True, timeout=START_S)
    return done.returncode, done.stdout + done.stderr


def test_a_second_pool_on_the_same_state_dir_is_refused_naming_the_first(tmp_path):
    shared = tmp_path / "shared"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Pool(tmp_path / "a", [synthetic("s", tokens=2)], server={"state_dir": str(shared)})
    second = Pool(tmp_path / "b", [synthetic("s", tokens=2)], server={"state_dir": str(shared)})
    first.start()
    try:
        code, output = serve_exits(second)
        assert code == 2, output[-2000:]
        assert "in use by another pool" in output and f"pid {first.proc.pid}" in output, output[-2000:]
        # the first pool goes on serving, and its rows are its own
        r = first.http.post("/v1/chat/completions", json={"model": "s", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        first.stop()
    # once the first has gone, the directory is free again
    again = Pool(tmp_path / "b", [synthetic("s", tokens=2)], server={"state_dir": str(shared)})
    again.start()
    again.stop()


@pytest.mark.parametrize("mode", [0o777, 0o720, 0o702])
def test_a_pool_dir_others_may_write_is_refused(tmp_path, mode):
    (tmp_path / "shared" / POOL_DIR_NAME).mkdir(parents=True)
    os.chmod(tmp_path / "shared" / POOL_DIR_NAME, mode)
    pool = Pool(tmp_path, [synthetic("s", tokens=2)], server={"state_dir": str(tmp_path / "shared")})
    code, output = serve_exits(pool)
    assert code == 2 and "writable by other users" in output, output[-2000:]
    assert not (tmp_path / "shared" / POOL_DIR_NAME / "requests.sqlite3").exists()  # nothing written there


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
@pytest.mark.parametrize("planted", ["directory", "link to theirs"])
def test_a_pool_dir_another_user_owns_is_refused(tmp_path, planted):
    """In a shared (1777) state_dir, `llm-pool` made by another user, or a link to a directory
    another user owns: refused, nothing written there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    theirs = shared / POOL_DIR_NAME if planted == "directory" else tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # nobody's
    if planted != "directory":
        os.symlink(theirs, shared / POOL_DIR_NAME)
    pool = Pool(tmp_path, [synthetic("s", tokens=2)], server={"state_dir": str(shared)})
    code, output = serve_exits(pool)
    assert code == 2 and "belongs to another user" in output, output[-2000:]
    assert not list(theirs.iterdir())


def test_the_lock_is_not_followed_through_a_link(tmp_path):
    """A link planted where the lock file goes is refused, not followed (O_NOFOLLOW)."""
    own = tmp_path / POOL_DIR_NAME
    own.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_text("not the pool's")
    os.symlink(target, own / LOCK_NAME)
    with pytest.raises(OSError):
        claim_state_dir(str(tmp_path))
    assert target.read_text() == "not the pool's"


def test_the_lock_is_held_only_while_its_process_lives(tmp_path):
    """A holder killed with SIGKILL leaves the directory free (the kernel drops its flock), and a
    runtime the pool starts does not inherit the lock."""
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time, subprocess; from supervisor.state_dir import claim_state_dir; "
                               f"claim_state_dir({str(tmp_path)!r}); "
                               "child = subprocess.Popen(['sleep', '60']); print(child.pid, flush=True); time.sleep(60)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(StateDirRefused, match=f"pid {holder.pid}"):
            claim_state_dir(str(tmp_path))
        holder.kill()
        holder.wait(10)
        claim_state_dir(str(tmp_path)).release()  # the child still runs, and holds nothing
    finally:
        holder.kill()
        holder.wait(10)
        os.kill(child, 9)
