"""What warm swaps keep on disk, per model, as /admin/models and `llm-pool models` show it:
read from the sidecars the workers write (runtime_worker/warm_swap.py, which owns the files,
their checks and the disk budget), off the loop, at most every SCAN_EVERY_S."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path

from supervisor.config import ServerConfig
from supervisor.config.models import WARM_SWAP_BACKENDS
from supervisor.models.registry import ModelEntry

log = logging.getLogger("llm_pool.warm_swaps")

SCAN_EVERY_S = 2.0
OFF_FILE = "OFF"  # runtime_worker.warm_swap.OFF_FILE: why a config's warm swaps were turned off


def scan(root: Path) -> dict[str, dict]:
    """Per model directory: its saved conversations, tokens and bytes, and why warm swaps are off
    for its config, if they are. Workers change the files meanwhile: what vanishes is skipped."""
    found: dict[str, dict] = {}
    try:
        model_dirs = [d for d in root.iterdir() if d.is_dir()]
    except OSError:  # not made yet, or unreadable: nothing saved that the pool can show
        return found
    for model_dir in model_dirs:
        saved = {"conversations": 0, "tokens": 0, "bytes": 0}
        off = None
        try:
            configs = [d for d in model_dir.iterdir() if d.is_dir()]
        except OSError:
            continue
        for config in configs:  # one, but for a moment after a config change
            for sidecar in config.glob("*.json"):
                try:
                    meta = json.loads(sidecar.read_text())
                    saved["tokens"] += int(meta["tokens"])
                    saved["bytes"] += int(meta["bytes"])
                    saved["conversations"] += 1
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # mid-write, or deleted meanwhile: the worker's checks judge it
            try:
                off = (config / OFF_FILE).read_text()[:500] or off
            except OSError:
                pass
        found[model_dir.name] = {"saved": saved, "off": off}
    return found


class SavedKv:
    def __init__(self, root: Path, server: Callable[[], ServerConfig]) -> None:
        self.root = root
        self._server = server  # the current [server] (its disk budget)
        self._by_model: dict[str, dict] = {}
        self._last = float("-inf")
        self._scanning: asyncio.Task | None = None

    def refresh_due(self, now: float, spawn: Callable[[Coroutine], asyncio.Task]) -> None:
        if now - self._last >= SCAN_EVERY_S and (self._scanning is None or self._scanning.done()):
            self._last = now
            self._scanning = spawn(self._refresh())

    async def _refresh(self) -> None:
        self._by_model = await asyncio.to_thread(scan, self.root)

    def view(self, entry: ModelEntry) -> dict | None:
        """The model's warm swaps: whether on (and why not), what is saved, and each running
        replica's last restore (its Ready info); None for a model whose runtime cannot save its KV."""
        if entry.cfg.backend not in WARM_SWAP_BACKENDS or entry.cfg.remote:
            return None
        disk = self._by_model.get(entry.cfg.name, {})
        replicas = entry.executor.replicas if entry.executor is not None else ()
        restores = [r.info["warm_swap"] for r in replicas if isinstance(r.info, dict) and "warm_swap" in r.info]
        off = next((r["off"] for r in restores if r.get("off")), None) or disk.get("off")
        if entry.cfg.warm_swap is False:
            off = "warm_swap = false"
        elif not self._server().kv_disk_budget_mb:
            off = "kv_disk_budget_mb = 0"
        return {"on": off is None, "off_reason": off,
                "saved": disk.get("saved", {"conversations": 0, "tokens": 0, "bytes": 0}),
                "last_restore": restores[0] if restores else None}
