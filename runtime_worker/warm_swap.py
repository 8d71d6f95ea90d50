"""Warm swaps (llama-server): the slots' KV saved to disk before a planned stop, and
restored after the next start, so that a conversation's next turn reads its prefix from the
runtime's cache instead of prefilling it again.

On disk, under the model's directory (`<state>/kv/<model>/`, from the supervisor):

    <config>/<stamp>-<slot>.bin   llama-server's own slot file (POST /slots/N?action=save)
    <config>/<stamp>-<slot>.json  what the pool knows of it: its config, tokens, bytes, digest
    <config>/OFF                  why warm swaps are off for this config (a restore did not take)

<config> is a hash of what makes a saved KV fit a runtime: the model file, the llama-server
binary, and its flags (context, slots, cache types, ...). A snapshot is only ever restored into
a runtime of its own config. A file that does not check out (no sidecar, another config,
truncated, another digest, refused by the runtime) is deleted and logged, never restored.

Only a planned stop saves (Shutdown, SIGTERM: unload, idle unload, eviction, reload, operator
restart); a crash cannot, and the next load restores what an earlier stop saved, if anything.
A worker holds an flock on each snapshot it restored, for its life: another replica of the
model starting meanwhile picks others, and once the worker is gone it may restore elsewhere.
Every restore is verified: a probe of the snapshot's own tokens (n_predict 0) must read them
from the runtime's cache; one that does not turns warm swaps off for the config (the OFF file
says why: llama.cpp has models and versions whose restores report success and do not take)."""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

log = logging.getLogger("llm_pool.worker.warm_swap")

SIDECAR_VERSION = 1
MIN_TOKENS = 32  # a shorter prefix is cheaper to prefill than to keep
SERVES = 0.5  # a snapshot is restored for a prompt when it holds at least this share of it
SUPERSEDES = 0.9  # a fresh save supersedes an older one that it starts with this share of (a later turn)
MAX_PENDING = 64  # snapshots left on disk after a start that a request may still restore (their tokens held)
TAKEN_SHARE = 0.8  # a probe must find this share of the restored tokens in the cache
PROBE_TIMEOUT_S = 15.0  # a probe reads its tokens from the cache in milliseconds; prefilling them takes longer
CALL_TIMEOUT_S = 60.0  # one save or restore call (its bytes go to or from the page cache)
STATE_MAGIC = 0x67677371  # llama.cpp's sequence state file ("ggsq")
PACKED_TOKENS = 0xFFFFFFFF  # its token payload starts with a packed header: this, a version, the count
OFF_FILE = "OFF"
DEFAULT_MIN_FREE_MB = 1024  # [server] kv_min_free_mb
SIDECAR_MAX_BYTES = 4096  # what seal() writes is about 250 bytes
PART = ".part"  # a save being written: invisible to every scan until its sidecar is there
# What the pool names, and so all it deletes: a config's directory (config_key) and a snapshot
# (save: `<ns stamp>-<slot>.bin`, its sidecar beside it). Anything else under kv/ is not the pool's.
CONFIG_DIR_NAME = re.compile(r"[0-9a-f]{16}")
SNAPSHOT_NAME = re.compile(r"[0-9]+-[0-9]+\.bin")
STALE_S = 600.0  # a .part or a sidecar without its .bin this old was left by a worker that died mid-save
MAX_MISSES = 32  # chat requests in a row that no waiting snapshot served: stop looking (they stay on disk)
# flags under which llama-server cannot save or restore a slot (no /slots; a multimodal projector)
NO_SLOT_FILES = {"--no-slots": "the runtime runs with --no-slots", "--mmproj": "a multimodal projector is loaded",
                 "-mm": "a multimodal projector is loaded", "--mmproj-url": "a multimodal projector is loaded",
                 "-mmu": "a multimodal projector is loaded"}
HEAD = struct.Struct("<III")
# llama-server's /slots is about 1.5 KB a slot (its sampling settings); with each slot's prompt
# and output text (LLAMA_SERVER_SLOTS_DEBUG=1, or an older build) it has no bound: read no more
SLOTS_MAX_BYTES = 1 * 2**20
SLOTS_PARSE_INLINE_BYTES = 64 * 1024  # a larger /slots answer is parsed on a thread, off the event loop


class BadSnapshot(Exception):
    """A snapshot that must not be restored; the message says why."""


class Unsupported(Exception):
    """The runtime cannot save or restore slots at all (it answered 501); the message says why."""


def config_key(binary: str, model: str, flags: list[str]) -> str:
    """What a saved KV must match to be restored: the binary and the model file (path, size,
    modification time) and the flags that shape the KV."""
    def stat(path: str) -> list:
        real = Path(path).resolve()
        info = real.stat()
        return [str(real), info.st_size, info.st_mtime_ns]
    key = json.dumps({"binary": stat(binary), "model": stat(model), "flags": flags}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def read_tokens(path: Path) -> array.array:
    """The token ids a llama.cpp slot file holds (its header and token payload; the KV follows)."""
    with open(path, "rb") as f:
        head = f.read(HEAD.size)
        if len(head) < HEAD.size:
            raise BadSnapshot("truncated (no header)")
        magic, _version, words = HEAD.unpack(head)
        if magic != STATE_MAGIC:
            raise BadSnapshot("not a llama.cpp slot file")
        payload = f.read(words * 4)
    if len(payload) < words * 4:
        raise BadSnapshot("truncated (token list)")
    values = array.array("I", payload)
    if sys.byteorder != "little":
        values.byteswap()
    if words >= 3 and values[0] == PACKED_TOKENS:
        count = values[2]
        if 3 + count > words:
            raise BadSnapshot("its token count exceeds its payload")
        return values[3:3 + count]
    return values


def digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def common_prefix(a, b) -> int:
    """How many leading token ids `a` and `b` share: a bisection over memory compares (C speed)."""
    a = memoryview(a if isinstance(a, array.array) else array.array("I", a)).cast("B")
    b = memoryview(b if isinstance(b, array.array) else array.array("I", b)).cast("B")
    lo, hi = 0, min(len(a), len(b)) // 4
    while lo < hi:  # the most tokens k with a[:k] == b[:k]
        mid = (lo + hi + 1) // 2
        if a[:4 * mid] == b[:4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Snapshot:
    path: Path  # the .bin
    tokens: array.array  # its token ids ("I": 4 bytes each, however many snapshots wait)
    saved_at: float
    size: int

    @property
    def sidecar(self) -> Path:
        return self.path.with_suffix(".json")


def remove(path: Path, why: str) -> None:
    """Delete a snapshot (its .bin and its sidecar), saying why; a disk that refuses is logged."""
    try:
        for p in (path.with_suffix(".bin"), path.with_suffix(".json")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    except OSError as exc:
        log.error("warm swap: cannot delete %s (%s): %s", path.with_suffix(".bin"), why, exc)
        return
    log.warning("warm swap: deleted %s: %s", path.with_suffix(".bin"), why)


class WarmSwap:
    """One worker's snapshots: where they live (`root`, the model's directory), the disk budget
    of every model's snapshots together (`budget_mb`, over the parent of `root`), and the
    snapshots this worker restored (held under flock until it exits)."""

    def __init__(self, root: str, budget_mb: float, save_timeout_s: float,
                 min_free_mb: float = DEFAULT_MIN_FREE_MB) -> None:
        self.root = Path(root)
        self.budget_bytes = int(budget_mb * 2**20)
        self.min_free_bytes = int(min_free_mb * 2**20)  # no save while the disk has less free (kv_min_free_mb)
        self.save_timeout_s = save_timeout_s
        self.dir: Path | None = None  # root/<config>, once the runtime's config is known
        self.held: dict[Path, int] = {}  # restored snapshot -> its locked fd
        # snapshots not restored at the start (more than slots): a chat request that one serves (SERVES)
        # has it restored then (restore_for), newest first, at most MAX_PENDING
        self.pending: list[Snapshot] = []
        self.misses = 0  # chat requests in a row that no pending snapshot served
        self.in_slot: dict[int, Snapshot] = {}  # slot -> the snapshot restored into it (held)
        self.reserved: set[int] = set()  # slots restored for a request that has not ended yet
        self.untouched: dict[int, object] = {}  # slot -> its task after the start's probe: unused since
        self.lock = asyncio.Lock()  # one restore on demand at a time (a slot is chosen, then filled)
        self.off_reason: str | None = None
        self.report: dict = {}  # the last restore's result, for the supervisor (Ready.info)

    # -- the config ----------------------------------------------------------------------------
    def prepare(self, binary: str, model: str, flags: list[str]) -> Path:
        """The directory for this runtime's config (made if new); snapshots of this model under
        any other config can never be restored: deleted, logged. Blocking: run in a thread."""
        key = config_key(binary, model, flags)
        self.dir = self.root / key
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.root.is_symlink():  # the pool makes none: whatever it names is not the pool's to delete in
            raise OSError(f"{self.root} is a symbolic link; warm swaps keep their files in a directory of their own")
        with os.scandir(self.root) as entries:
            others = [Path(e.path) for e in entries if e.name != key and CONFIG_DIR_NAME.fullmatch(e.name)
                      and e.is_dir(follow_symlinks=False)]
        for other in others:
            count = len(list(other.glob("*.bin")))
            shutil.rmtree(other, ignore_errors=True)  # follows no link inside it
            log.warning("warm swap: deleted %d snapshots of another config (%s): the model file, the "
                        "binary or a flag changed", count, other.name)
        self.dir.mkdir(exist_ok=True, mode=0o700)
        if self.off_written():
            for bin_path in self.dir.glob("*.bin"):  # saved by a replica that had not seen it yet
                remove(bin_path, "warm swaps are off for this config")
        now = time.time()
        for left in [*self.dir.glob(f"*{PART}"), *self.dir.glob("*.json.tmp")]:
            with contextlib.suppress(OSError):
                if now - left.stat().st_mtime > STALE_S:
                    left.unlink()
        return self.dir

    def off_written(self) -> bool:
        """Whether this config's OFF file is there (another replica may have written it); if so,
        off_reason says why."""
        off = self.dir / OFF_FILE if self.dir else None
        if off is None or not off.is_file():
            return False
        self.off_reason = self.off_reason or off.read_text()[:500] or "off"
        return True

    def turn_off(self, reason: str) -> None:
        """No more saves or restores for this config: the OFF file says why; its snapshots go."""
        self.off_reason = reason
        self.pending = []
        for path in list(self.held):
            self.release(path)
        assert self.dir is not None
        for bin_path in self.dir.glob("*.bin"):
            remove(bin_path, "warm swaps are off for this config")
        try:
            (self.dir / OFF_FILE).write_text(reason)
        except OSError as exc:  # off for this worker still; the next start tries again
            log.error("warm swap: cannot write %s: %s", self.dir / OFF_FILE, exc)
        log.error("warm swap: off for this model: %s", reason)

    # -- reading snapshots (blocking: run in a thread) -------------------------------------------------
    def check(self, bin_path: Path, full: bool) -> Snapshot:
        """A snapshot as its sidecar says, checked: its config, its size, its token list, and
        (`full`) its digest. Raises BadSnapshot."""
        sidecar = bin_path.with_suffix(".json")
        if not stat.S_ISREG(bin_path.lstat().st_mode):  # a FIFO would block the read, a link lead elsewhere
            raise BadSnapshot("not a regular file")
        try:
            info = sidecar.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_size > SIDECAR_MAX_BYTES:
                raise BadSnapshot(f"its sidecar is not a regular file of at most {SIDECAR_MAX_BYTES} bytes")
            meta = json.loads(sidecar.read_text())
        except FileNotFoundError:
            raise BadSnapshot("no sidecar: not saved by the pool") from None
        except (ValueError, OSError) as exc:
            raise BadSnapshot(f"unreadable sidecar ({exc})") from None
        if not isinstance(meta, dict) or meta.get("version") != SIDECAR_VERSION:
            raise BadSnapshot("a sidecar of another version")
        if meta.get("config") != bin_path.parent.name:
            raise BadSnapshot(f"saved under another config ({meta.get('config')})")
        size = bin_path.stat().st_size
        if size != meta.get("bytes"):
            raise BadSnapshot(f"{size} bytes, saved as {meta.get('bytes')} (truncated or changed)")
        tokens = read_tokens(bin_path)
        if len(tokens) != meta.get("tokens"):
            raise BadSnapshot(f"{len(tokens)} tokens, saved as {meta.get('tokens')}")
        if full and digest(bin_path) != meta.get("digest"):
            raise BadSnapshot("its digest differs from the one saved (corrupt)")
        return Snapshot(bin_path, tokens, float(meta.get("saved_at", 0)), size)

    def snapshots(self) -> list[Snapshot]:
        """This config's snapshots that check out (without digests), newest first; the rest deleted."""
        found = []
        for bin_path in self.dir.glob("*.bin") if self.dir else ():
            if not SNAPSHOT_NAME.fullmatch(bin_path.name):
                continue  # not named as the pool names its snapshots: not the pool's to read or delete
            try:
                found.append(self.check(bin_path, full=False))
            except FileNotFoundError:
                continue  # deleted meanwhile (another replica's save superseded it)
            except BadSnapshot as exc:
                remove(bin_path, str(exc))
        now = time.time()
        for orphan in self.dir.glob("*.json") if self.dir else ():
            with contextlib.suppress(OSError):  # a fresh one belongs to a save about to rename its .part
                if not orphan.with_suffix(".bin").exists() and now - orphan.stat().st_mtime > STALE_S:
                    orphan.unlink()
        return sorted(found, key=lambda s: s.saved_at, reverse=True)

    @staticmethod
    def _lock(path: Path) -> int | None:
        """An fd of `path` holding its exclusive lock; None when it is gone or another live
        worker holds it (restored by another replica of the model)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def claim_one(self, snap: Snapshot) -> bool:
        """Lock `snap` for this worker's life, its digest checked; False when another worker
        holds it or it does not check out (then deleted). Either way it is no longer pending."""
        self.pending = [s for s in self.pending if s is not snap]
        fd = self._lock(snap.path)
        if fd is None:
            return False
        try:
            self.check(snap.path, full=True)
            os.utime(snap.path)  # used now: the disk budget drops the least recently used first
        except BadSnapshot as exc:
            os.close(fd)
            remove(snap.path, str(exc))
            return False
        except OSError as exc:  # gone meanwhile, or a disk that refuses: not this one
            os.close(fd)
            log.warning("warm swap: %s not claimed: %s", snap.path.name, exc)
            return False
        self.held[snap.path] = fd
        return True

    def claim(self, limit: int) -> list[Snapshot]:
        """Up to `limit` of the newest snapshots no other worker holds, each claimed (claim_one)."""
        claimed = []
        for snap in self.snapshots():
            if len(claimed) >= limit:
                break
            if self.claim_one(snap):
                claimed.append(snap)
        return claimed

    def unclaimed(self, limit: int) -> list[Snapshot]:
        """The newest snapshots no worker holds, left unlocked (a request may claim one later)."""
        found = []
        for snap in self.snapshots():
            if len(found) >= limit:
                break
            fd = None if snap.path in self.held else self._lock(snap.path)
            if fd is not None:
                os.close(fd)  # closing drops the lock taken to ask
                found.append(snap)
        return found

    def serving(self, tokens: list[int]) -> Snapshot | None:
        """The pending snapshot that holds the longest start of `tokens`, if that is at least
        SERVES of them (and MIN_TOKENS): a later turn of its conversation, or the same turn again."""
        best, best_n = None, max(MIN_TOKENS, SERVES * len(tokens)) - 1
        for snap in self.pending:
            n = common_prefix(snap.tokens, tokens)
            if n > best_n:
                best, best_n = snap, n
        return best

    def release(self, path: Path) -> None:
        fd = self.held.pop(path, None)
        if fd is not None:
            os.close(fd)

    # -- writing (blocking: run in a thread) ---------------------------------------------------------
    def seal(self, part: Path) -> Snapshot:
        """A fresh save (`<name>.part`) made a snapshot: its sidecar written (tokens, size,
        digest), then renamed `<name>.bin`, so that no scan sees it before it checks out."""
        bin_path = part.with_suffix(".bin")
        tokens = read_tokens(part)
        meta = {"version": SIDECAR_VERSION, "config": bin_path.parent.name, "tokens": len(tokens),
                "bytes": part.stat().st_size, "digest": digest(part), "saved_at": time.time()}
        tmp = bin_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(bin_path.with_suffix(".json"))
        part.replace(bin_path)
        return Snapshot(bin_path, tokens, meta["saved_at"], meta["bytes"])

    def supersede(self, fresh: list[Snapshot]) -> None:
        """A snapshot whose tokens a fresh one continues (the same conversation, a later turn) is
        superseded: deleted. "Continues" is by ratio, not exactly: the fresh one is at least as
        long and shares the first SUPERSEDES of the old one's tokens (a later turn's prompt is the
        earlier one re-tokenized through the chat template, not always the same ids). Two
        conversations that share that much (a long common system prompt) count as one."""
        fresh_paths = {s.path for s in fresh}
        for old in self.snapshots():
            if old.path in fresh_paths:
                continue
            for new in fresh:
                if (len(new.tokens) >= len(old.tokens)
                        and common_prefix(old.tokens, new.tokens) >= SUPERSEDES * len(old.tokens)):
                    self.release(old.path)
                    for p in (old.path, old.sidecar):
                        with contextlib.suppress(FileNotFoundError):
                            p.unlink()
                    log.info("warm swap: %s superseded by %s", old.path.name, new.path.name)
                    break

    def trim(self) -> None:
        """Every model's snapshots together within the disk budget: the least recently used (saved
        or restored: a claim touches its file) go first."""
        files = []
        for bin_path in self.root.parent.glob("*/*/*.bin"):
            if not (SNAPSHOT_NAME.fullmatch(bin_path.name) and CONFIG_DIR_NAME.fullmatch(bin_path.parent.name)):
                continue  # not named as the pool names its snapshots: not the pool's
            with contextlib.suppress(FileNotFoundError):
                info = bin_path.lstat()
                if stat.S_ISREG(info.st_mode) and bin_path.with_suffix(".json").exists() \
                        and not bin_path.parent.is_symlink() and not bin_path.parent.parent.is_symlink():
                    files.append((info.st_mtime, info.st_size, bin_path))
        total = sum(size for _, size, _ in files)
        for _, size, bin_path in sorted(files):
            if total <= self.budget_bytes:
                break
            self.release(bin_path)
            remove(bin_path, f"over kv_disk_budget_mb ({self.budget_bytes / 2**20:g} MiB), the least recently saved")
            total -= size


class SlotsTooLarge(Exception):
    """llama-server's /slots answered more than SlotClient's byte cap (SLOTS_MAX_BYTES)."""


class SlotClient:
    """llama-server's slot calls, with its key: the one reader of its GET /slots (warm swaps,
    llama_tasks.TaskTies), whose answer is read up to `max_bytes` and parsed off the event loop
    when large (LLAMA_SERVER_SLOTS_DEBUG, or an older build, puts each slot's prompt text in it).

    GET /slots goes over aiohttp, not the `control` client (httpx): a task tie asks it once per
    job, just after the job's first token, and httpx spent about 1.4 ms of the worker's CPU on
    it (aiohttp 0.3): time taken from that first token on its way to the client on a busy CPU."""

    def __init__(self, control: httpx.AsyncClient, base_url: str, max_bytes: int = SLOTS_MAX_BYTES) -> None:
        self.control = control
        self.base_url = base_url
        self.max_bytes = max_bytes
        self._session: aiohttp.ClientSession | None = None  # made on first use, inside the running loop

    def _reader(self) -> aiohttp.ClientSession:
        if self._session is None:
            key = self.control.headers.get("authorization")
            # identity asked: the cap counts the bytes as sent
            self._session = aiohttp.ClientSession(
                headers={"Accept-Encoding": "identity", **({"Authorization": key} if key else {})},
                auto_decompress=False, timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        return self._session

    async def slots(self) -> list[dict]:
        """GET /slots: each slot's id, task (`id_task`), `is_processing` and sampling `params`.
        Raises SlotsTooLarge past max_bytes (the read stops there), aiohttp errors, ValueError."""
        async with self._reader().get(self.base_url + "/slots", allow_redirects=False) as r:
            r.raise_for_status()
            if r.content_length is not None and r.content_length > self.max_bytes:
                raise SlotsTooLarge(f"/slots is {r.content_length} bytes, over the cap of {self.max_bytes}")
            body = bytearray()
            async for part in r.content.iter_any():
                body += part
                if len(body) > self.max_bytes:
                    raise SlotsTooLarge(f"/slots is over the cap of {self.max_bytes} bytes (read stopped there)")
        if len(body) > SLOTS_PARSE_INLINE_BYTES:
            return await asyncio.to_thread(json.loads, body)
        return json.loads(body)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def action(self, slot: int, action: str, filename: str) -> dict:
        r = await self.control.post(f"{self.base_url}/slots/{slot}?action={action}", json={"filename": filename},
                                    timeout=CALL_TIMEOUT_S)
        if r.status_code == 501:
            raise Unsupported(f"the runtime cannot {action} a slot: {r.text[:200]}")
        if r.status_code != 200:
            raise BadSnapshot(f"{action} answered {r.status_code}: {r.text[:200]}")
        return r.json()

    async def chat_tokens(self, request: dict) -> list[int]:
        """A chat request's prompt as the runtime tokenizes it: its template applied, then its
        tokens with the special ones (what a slot's cache holds for it)."""
        r = await self.control.post(self.base_url + "/apply-template", json=request, timeout=CALL_TIMEOUT_S)
        r.raise_for_status()
        r = await self.control.post(self.base_url + "/tokenize", timeout=CALL_TIMEOUT_S, json={
            "content": r.json()["prompt"], "add_special": True, "parse_special": True})
        r.raise_for_status()
        return r.json()["tokens"]

    async def cached(self, slot: int, tokens) -> int:
        """How many of `tokens` the slot reads from its cache: a probe that generates nothing, sent
        as the pool's requests are (the runtime's own cache_prompt setting)."""
        r = await self.control.post(self.base_url + "/completion", timeout=PROBE_TIMEOUT_S, json={
            "prompt": list(tokens), "n_predict": 0, "id_slot": slot})
        r.raise_for_status()
        return int((r.json().get("timings") or {}).get("cache_n") or 0)


async def restore(ws: WarmSwap, client: SlotClient, slots: int) -> dict:
    """Restore the newest snapshots into the idle slots of a runtime just started, each verified;
    returns what happened (for the supervisor's Ready.info). Never raises (but CancelledError):
    whatever fails here leaves the load cold, not failed."""
    started = time.monotonic()
    if ws.off_reason:
        ws.report = {"restored": 0, "off": ws.off_reason}
        return ws.report
    restored, tokens, note = 0, 0, None
    try:
        claimed = await asyncio.to_thread(ws.claim, slots)
        for slot, snap in enumerate(claimed):
            if note is not None:  # the runtime stalled on an earlier one: the rest wait on disk
                ws.release(snap.path)
                continue
            try:
                await client.action(slot, "restore", snap.path.name)
                cached = await client.cached(slot, snap.tokens)
            except httpx.TransportError as exc:  # a stall proves nothing of the file: it stays
                ws.release(snap.path)
                note = f"not verified: the runtime did not answer ({type(exc).__name__}); left on disk"
                continue
            except BadSnapshot as exc:
                ws.release(snap.path)
                await asyncio.to_thread(remove, snap.path, f"the runtime refused it: {exc}")
                continue
            if cached < TAKEN_SHARE * len(snap.tokens):
                reason = (f"a restore did not take: the runtime read {cached} of {len(snap.tokens)} restored "
                          f"tokens from its cache (this model or llama-server version gets no reuse from a "
                          f"restored slot)")
                await asyncio.to_thread(ws.turn_off, reason)
                ws.report = {"restored": 0, "off": reason}
                return ws.report
            ws.in_slot[slot] = snap
            restored += 1
            tokens += len(snap.tokens)
        if restored:  # each restored slot's probe left a task on it: unused since, it needs no new save
            ws.untouched = {s["id"]: s.get("id_task") for s in await client.slots() if s["id"] in ws.in_slot}
        ws.pending = await asyncio.to_thread(ws.unclaimed, MAX_PENDING)
    except Unsupported as exc:
        await asyncio.to_thread(ws.turn_off, str(exc))
        ws.report = {"restored": 0, "off": str(exc)}
        return ws.report
    except Exception as exc:  # a disk that refuses, an answer that is not JSON: cold, and said
        log.error("warm swap: the restore failed (%r); the load goes on cold", exc)
        note = f"failed: {exc!r}"[:300]
    ws.report = {"restored": restored, "tokens": tokens, "ms": round((time.monotonic() - started) * 1000, 1),
                 "off": None, "on_disk": len(ws.pending), **({"note": note} if note else {})}
    if restored:
        log.info("warm swap: restored %d conversations (%d tokens) in %.0f ms", restored, tokens, ws.report["ms"])
    return ws.report


async def restore_for(ws: WarmSwap, client: SlotClient, request: dict) -> int | None:
    """For a chat request while snapshots wait on disk: the idle slot that a snapshot holding
    most of its prompt was restored into (the request then asks for that slot, reserved for it
    until it ends: release_slot), or None (nothing serves it, no idle slot, or a failure, which
    is logged: the request runs as it would have). One at a time."""
    try:
        tokens = await client.chat_tokens(request)
        async with ws.lock:
            snap = await asyncio.to_thread(ws.serving, array.array("I", tokens)) if ws.pending else None
            if snap is None:
                ws.misses += 1
                if ws.misses >= MAX_MISSES and ws.pending:
                    log.info("warm swap: %d requests in a row continued none of the %d snapshots on disk; "
                             "no more looking (they wait for the next load)", ws.misses, len(ws.pending))
                    ws.pending = []
                return None
            ws.misses = 0
            idle = [s["id"] for s in await client.slots() if not s.get("is_processing") and s["id"] not in ws.reserved]
            # a slot that holds no restored conversation first
            idle.sort(key=lambda slot: slot in ws.in_slot)
            if not idle or not await asyncio.to_thread(ws.claim_one, snap):
                return None
            slot = int(idle[0])
            await client.action(slot, "restore", snap.path.name)
            evicted = ws.in_slot.pop(slot, None)
            if evicted is not None:  # its conversation is on disk again, for whoever it serves next
                ws.release(evicted.path)
                ws.pending.append(evicted)
            ws.in_slot[slot] = snap
            ws.reserved.add(slot)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("warm swap: no restore for this request: %r", exc)
        return None
    log.info("warm swap: restored %s (%d tokens) into slot %s for a request it serves",
             snap.path.name, len(snap.tokens), slot)
    return slot


async def save(ws: WarmSwap, client: SlotClient) -> dict:
    """Save every slot that served a request since the start (not one that only a restore and its
    probe touched); then drop what the fresh saves supersede, and trim every model's snapshots to
    the disk budget. A slot that fails is logged; the others are still saved."""
    if ws.off_reason or ws.dir is None or await asyncio.to_thread(ws.off_written):
        return {"saved": 0}
    free = (await asyncio.to_thread(shutil.disk_usage, ws.dir)).free
    if free < ws.min_free_bytes:  # a full disk would fail the saves, and whatever else writes there
        log.warning("warm swap: nothing saved: %d MiB free on the state directory's disk, under kv_min_free_mb "
                    "(%d MiB)", free >> 20, ws.min_free_bytes >> 20)
        return {"saved": 0, "skipped": "disk"}
    started = time.monotonic()
    stamp = time.time_ns()
    fresh = []
    for slot in await client.slots():
        task = slot.get("id_task")
        if task in (None, -1) or ws.untouched.get(slot.get("id"), object()) == task:
            continue  # nothing served since the start (a restore's file is still on disk)
        part = ws.dir / f"{stamp}-{slot['id']}{PART}"
        try:
            answer = await client.action(int(slot["id"]), "save", part.name)
            if int(answer.get("n_saved") or 0) < MIN_TOKENS:
                await asyncio.to_thread(part.unlink, True)
                continue
            fresh.append(await asyncio.to_thread(ws.seal, part))
        except Unsupported as exc:
            await asyncio.to_thread(ws.turn_off, str(exc))
            return {"saved": 0}
        except (BadSnapshot, httpx.HTTPError, OSError, ValueError) as exc:
            log.warning("warm swap: slot %s not saved: %r", slot.get("id"), exc)
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)
    await asyncio.to_thread(ws.supersede, fresh)
    await asyncio.to_thread(ws.trim)
    report = {"saved": len(fresh), "tokens": sum(len(s.tokens) for s in fresh),
              "bytes": sum(s.size for s in fresh), "ms": round((time.monotonic() - started) * 1000, 1)}
    log.info("warm swap: saved %d conversations (%d tokens, %d bytes) in %.0f ms", report["saved"],
             report["tokens"], report["bytes"], report["ms"])
    return report
