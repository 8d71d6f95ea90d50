"""Warm swaps end to end, on a real llama-server with the tiny GGUF: a conversation's KV is saved
before a planned stop (unload, idle unload, eviction) and restored after the next load, so the
next turn's prefix comes from the runtime's cache (its own `cached_tokens`, never the pool's
guess). A crash saves nothing; a file that does not check out is deleted and logged, never
restored; the disk budget drops the least recently used; a restore that does not take turns
the feature off for the model, with the reason shown."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest

from runtime_worker.warm_swap import WarmSwap
from tests.conftest import llama
from tests.test_cli import cli
from tests.pool import wait_for
from tests.test_lifecycle import admin
from tests.test_prefix_routing_llama import words

pytestmark = pytest.mark.llama

TAKEN = 0.8  # the bound: the next turn reads at least this share of its prompt from the cache


def tiny(tiny_gguf: str, llama_server_bin: str, name: str = "tiny", ctx: int = 4096, **extra) -> dict:
    return llama(name, tiny_gguf, llama_server_bin, slots=1, ctx=ctx, **extra)


class Conversation:
    """A ~1,000-token conversation whose answers in its history are fixed text, so each turn's
    prompt extends the last one."""

    def __init__(self, pool, model: str, seed: int = 0) -> None:
        self.pool, self.model = pool, model
        self.rng = random.Random(seed)
        self.messages = [{"role": "system", "content": words(self.rng, 200)}]

    def turn(self) -> tuple[int, int]:
        """One turn: (prompt tokens, of them cached), as the runtime reported them."""
        self.messages.append({"role": "user", "content": words(self.rng, 10)})
        r = self.pool.http.post("/v1/chat/completions", timeout=120, json={
            "model": self.model, "messages": self.messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
        self.messages.append({"role": "assistant", "content": words(self.rng, 8)})
        usage = r.json()["usage"]
        return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def warm_swap(pool, model: str) -> dict:
    return pool.model(model)["warm_swap"]


def saved(pool, model: str) -> int:
    return warm_swap(pool, model)["saved"]["conversations"]


def state_dir(pool) -> Path:
    return pool.config_path.parent / "state" / "llm-pool"


def kv_dir(pool, model: str) -> Path:
    return state_dir(pool) / "kv" / model


def snapshots(pool, model: str) -> list[Path]:
    return sorted(kv_dir(pool, model).glob("*/*.bin"))


def unload(pool, model: str) -> None:
    assert admin(pool, model, "unload").status_code == 200
    wait_for(lambda: pool.model(model)["state"] == "unloaded", 30, what=f"{model} unloaded")


def load(pool, model: str) -> None:
    assert admin(pool, model, "load").status_code == 200
    wait_for(lambda: pool.model(model)["state"] == "loaded", 60, what=f"{model} loaded")


def test_after_an_unload_and_a_load_the_next_turn_reads_its_prefix_from_the_cache(
        make_pool, tiny_gguf, llama_server_bin):
    pool = make_pool([tiny(tiny_gguf, llama_server_bin), tiny(tiny_gguf, llama_server_bin, "cold", warm_swap=False)])
    for model in ("tiny", "cold"):
        talk = Conversation(pool, model)
        prompt, cached = talk.turn()
        assert prompt > 500 and cached == 0
        unload(pool, model)
        load(pool, model)
        prompt, cached = talk.turn()
        print(f"{model}: next turn after unload and load: {cached} of {prompt} prompt tokens cached")
        if model == "tiny":
            assert cached >= TAKEN * prompt, (cached, prompt)
            view = warm_swap(pool, model)
            assert view["on"] and view["last_restore"]["restored"] == 1, view
            assert view["last_restore"]["tokens"] > 500
        else:  # the same steps without warm swaps: a cold prefill
            assert cached == 0
            assert warm_swap(pool, model) == {"on": False, "off_reason": "warm_swap = false", "last_restore": None,
                                              "saved": {"conversations": 0, "tokens": 0, "bytes": 0}}
            assert pool.model("cold")["backend"] == "llama_server"
            assert not kv_dir(pool, model).exists()
    # the restored conversation's later turn superseded its first save: one file, not two
    unload(pool, "tiny")
    wait_for(lambda: saved(pool, "tiny") == 1, 10, what="the saved KV shown")
    assert len(snapshots(pool, "tiny")) == 1
    assert warm_swap(pool, "tiny")["saved"]["tokens"] > 500
    rows = {line.split()[0]: line for line in cli("models", "-o", "wide", url=pool.url).stdout.splitlines()[1:]}
    assert "on, 1 saved (" in rows["tiny"] and "off: warm_swap = false" in rows["cold"], rows


def test_an_idle_unload_and_an_eviction_save_and_a_crash_does_not(make_pool, tiny_gguf, llama_server_bin):
    # a memory budget of one of a and b; idle unloads itself before they load
    models = [tiny(tiny_gguf, llama_server_bin, name, load_on_start=False, memory_mb=100) for name in ("a", "b")]
    models.append(tiny(tiny_gguf, llama_server_bin, "idle", load_on_start=False, idle_unload_s=1.0, memory_mb=10))
    pool = make_pool(models, server={"memory_budget_mb": 150, "heartbeat_s": 0.2})
    Conversation(pool, "idle").turn()
    wait_for(lambda: pool.model("idle")["state"] == "unloaded", 30, what="idle unload")
    wait_for(lambda: saved(pool, "idle") == 1, 10, what="the idle unload's save")

    Conversation(pool, "a").turn()
    Conversation(pool, "b").turn()  # evicts a
    wait_for(lambda: pool.model("a")["state"] == "unloaded", 30, what="a evicted")
    wait_for(lambda: saved(pool, "a") == 1, 10, what="the eviction's save")

    # a crash: its runtime killed; the worker's restart finds nothing saved for b
    pid = pool.workers("b")[0]["runtime_info"]["child_pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: pool.workers("b")[0]["restarts"] >= 1 and pool.model("b")["state"] == "loaded", 60,
             what="b restarted after its crash")
    view = warm_swap(pool, "b")
    assert view["saved"]["conversations"] == 0 and view["last_restore"]["restored"] == 0, view
    assert not snapshots(pool, "b")


def test_a_file_that_does_not_check_out_is_deleted_and_logged_never_restored(make_pool, tiny_gguf,
                                                                               llama_server_bin):
    # c's flags differ (its context): b's snapshot is of another config for c
    pool = make_pool([tiny(tiny_gguf, llama_server_bin, name, ctx=3072 if name == "c" else 4096)
                      for name in ("a", "b", "c", "d")])
    for seed, model in enumerate("abcd"):
        Conversation(pool, model, seed).turn()
        unload(pool, model)
        wait_for(lambda: len(snapshots(pool, model)) == 1, 10, what=f"{model}'s save")
    # a: a byte of its KV flipped; b: truncated; c: b's snapshot, sidecar and all, in c's place
    a = snapshots(pool, "a")[0]
    data = bytearray(a.read_bytes())
    data[len(data) // 2] ^= 0xFF
    a.write_bytes(bytes(data))
    b = snapshots(pool, "b")[0]
    b_bytes = b.read_bytes()
    c = snapshots(pool, "c")[0]
    c.write_bytes(b_bytes)
    c.with_suffix(".json").write_text(b.with_suffix(".json").read_text())
    with open(b, "r+b") as f:
        f.truncate(len(b_bytes) // 2)
    # d: a file nobody saved (no sidecar), named as the pool names its snapshots; and one named
    # otherwise, not the pool's: never read or restored, and left where it is
    d_dir = snapshots(pool, "d")[0].parent
    (d_dir / "1-0.bin").write_bytes(b_bytes)
    (d_dir / "stray.bin").write_bytes(b_bytes)
    for model, why in (("a", "corrupt"), ("b", "truncated"), ("c", "another config"), ("d", "no sidecar")):
        load(pool, model)
        restore = warm_swap(pool, model)["last_restore"]
        assert restore["restored"] == (1 if model == "d" else 0), (model, restore)
        assert (model == "d") == bool(snapshots(pool, model)), model  # d's own snapshot is still there
        wait_for(lambda: "warm swap: deleted" in worker_log(pool, model) and why in worker_log(pool, model), 5,
                 what=f"{model}'s deletion logged with its reason ({why})")
    assert not (d_dir / "1-0.bin").exists()
    assert (d_dir / "stray.bin").read_bytes() == b_bytes


def worker_log(pool, model: str) -> str:
    return (state_dir(pool) / "logs" / f"{model}-0.log").read_text(errors="replace")


def test_the_disk_budget_drops_the_least_recently_used(make_pool, tiny_gguf, llama_server_bin):
    budget_mb = 0.5  # one of these conversations' snapshots (~0.3 MB), not two
    pool = make_pool([tiny(tiny_gguf, llama_server_bin, name) for name in ("a", "b")],
                     server={"kv_disk_budget_mb": budget_mb})
    Conversation(pool, "a").turn()
    unload(pool, "a")
    wait_for(lambda: len(snapshots(pool, "a")) == 1, 10, what="a's save")
    one = snapshots(pool, "a")[0].stat().st_size
    assert budget_mb / 2 < one / 2**20 < budget_mb, one  # the test's premise
    Conversation(pool, "b", seed=1).turn()
    unload(pool, "b")
    wait_for(lambda: len(snapshots(pool, "b")) == 1 and not snapshots(pool, "a"), 10, what="a's dropped")
    assert "over kv_disk_budget_mb" in worker_log(pool, "b")


def test_nothing_is_saved_while_the_disk_is_under_its_free_floor(make_pool, tiny_gguf, llama_server_bin):
    """Issue 53: a full disk is not a crash. With less free than kv_min_free_mb (here more than any
    disk has), a stop saves nothing, says why in the replica's log, and the model unloads and
    loads again as ever."""
    pool = make_pool([tiny(tiny_gguf, llama_server_bin)], server={"kv_min_free_mb": 2**40})
    Conversation(pool, "tiny").turn()
    unload(pool, "tiny")
    wait_for(lambda: "nothing saved" in worker_log(pool, "tiny") and "kv_min_free_mb" in worker_log(pool, "tiny"),
             10, what="the skipped save logged")
    assert not snapshots(pool, "tiny")
    load(pool, "tiny")
    Conversation(pool, "tiny", seed=1).turn()


def test_a_restore_that_does_not_take_turns_warm_swaps_off_with_the_reason(make_pool, tiny_gguf,
                                                                          llama_server_bin):
    # --no-cache-prompt: the runtime saves and restores slots, and then reads nothing from them
    pool = make_pool([tiny(tiny_gguf, llama_server_bin, extra_args=["--no-cache-prompt"])])
    Conversation(pool, "tiny").turn()
    unload(pool, "tiny")
    wait_for(lambda: saved(pool, "tiny") == 1, 10, what="the save")
    load(pool, "tiny")
    view = warm_swap(pool, "tiny")
    assert not view["on"] and "did not take" in view["off_reason"], view
    assert not snapshots(pool, "tiny")
    # off stays off: the next stop saves nothing, the next load restores nothing, the reason stays
    Conversation(pool, "tiny", seed=1).turn()
    unload(pool, "tiny")
    load(pool, "tiny")
    view = warm_swap(pool, "tiny")
    assert not snapshots(pool, "tiny") and "did not take" in view["off_reason"], view
    assert json.loads(json.dumps(view))["last_restore"]["restored"] == 0


def test_replicas_share_the_snapshots_and_each_restores_its_own(make_pool, tiny_gguf, llama_server_bin):
    """Two replicas, a conversation on each: the unload saves both; at the next load each replica
    claims one (a claim is a lock its worker holds): neither restores both, none is lost."""
    pool = make_pool([tiny(tiny_gguf, llama_server_bin, replicas=2, routing="least_inflight")])
    for seed in (0, 1):  # least_inflight, one at a time: round-robin puts one on each replica
        Conversation(pool, "tiny", seed).turn()
    unload(pool, "tiny")
    wait_for(lambda: len(snapshots(pool, "tiny")) == 2, 10, what="both replicas' saves")
    load(pool, "tiny")
    restores = [w["runtime_info"]["warm_swap"] for w in pool.workers("tiny")]
    assert sorted(r["restored"] for r in restores) == [1, 1], restores


def test_an_operator_restart_saves_and_a_changed_flag_drops_the_old_config(make_pool, tiny_gguf, llama_server_bin):
    models = [tiny(tiny_gguf, llama_server_bin)]
    pool = make_pool(models)
    talk = Conversation(pool, "tiny")
    talk.turn()
    assert admin(pool, "tiny", "restart").status_code == 200
    wait_for(lambda: pool.workers("tiny")[0]["planned_restarts"] == 1 and pool.model("tiny")["state"] == "loaded",
             60, what="the operator's restart")
    assert warm_swap(pool, "tiny")["last_restore"]["restored"] == 1
    prompt, cached = talk.turn()
    assert cached >= TAKEN * prompt, (cached, prompt)
    # a reload that changes the context: the KV no longer fits; the old config's snapshots go, logged
    old_config = snapshots(pool, "tiny")[0].parent.name if snapshots(pool, "tiny") else None
    models[0]["options"]["ctx_size"] = 2048
    pool.rewrite_config(models)
    assert pool.http.post("/admin/reload", timeout=120).status_code == 200
    wait_for(lambda: pool.model("tiny")["state"] == "loaded" and pool.model("tiny")["context_length"] == 2048, 60,
             what="the reloaded model")
    configs = [d.name for d in kv_dir(pool, "tiny").iterdir()]
    assert len(configs) == 1 and configs[0] != old_config, configs
    assert "snapshots of another config" in worker_log(pool, "tiny")
    assert warm_swap(pool, "tiny")["last_restore"]["restored"] == 0


def test_a_conversation_left_on_disk_is_restored_when_its_next_turn_comes(make_pool, tiny_gguf, llama_server_bin):
    """One slot, two conversations saved: the load restores the newest (b); a's next turn finds
    its snapshot on disk, which is restored into an idle slot for it, and reads its prefix."""
    pool = make_pool([tiny(tiny_gguf, llama_server_bin)])
    a, b = Conversation(pool, "tiny", seed=0), Conversation(pool, "tiny", seed=1)
    a.turn()
    unload(pool, "tiny")
    load(pool, "tiny")
    b.turn()  # the slot now holds b; a's snapshot stays on disk
    unload(pool, "tiny")
    wait_for(lambda: len(snapshots(pool, "tiny")) == 2, 10, what="a's and b's snapshots")
    load(pool, "tiny")
    restore = warm_swap(pool, "tiny")["last_restore"]
    assert restore["restored"] == 1 and restore["on_disk"] == 1, restore
    prompt, cached = a.turn()
    print(f"a's next turn, restored on demand: {cached} of {prompt} prompt tokens cached")
    assert cached >= TAKEN * prompt, (cached, prompt)
    assert "for a request it serves" in worker_log(pool, "tiny")
    # a's restore took b's slot: b's snapshot went back on disk, and b's next turn restores it
    prompt, cached = b.turn()
    assert cached >= TAKEN * prompt, (cached, prompt)


def test_where_a_runtime_cannot_save_its_slots_the_load_goes_on_cold_and_says_why(
        make_pool, tiny_gguf, llama_server_bin):
    """--no-slots (no slot calls at all), and a state directory that refuses (a file where the
    model's directory would be): warm swaps are off for that worker, with the reason; the model
    loads and serves."""
    pool = make_pool([tiny(tiny_gguf, llama_server_bin, "noslots", extra_args=["--no-slots"]),
                      tiny(tiny_gguf, llama_server_bin, "refused", load_on_start=False)])
    kv_dir(pool, "refused").parent.mkdir(parents=True, exist_ok=True)
    kv_dir(pool, "refused").write_text("not a directory")
    load(pool, "refused")
    for model, why in (("noslots", "--no-slots"), ("refused", "the state directory refused")):
        Conversation(pool, model).turn()
        view = warm_swap(pool, model)
        assert not view["on"] and why in view["off_reason"], (model, view)
        unload(pool, model)  # and its stop saves nothing, quietly
        assert "Traceback" not in worker_log(pool, model)


# -- what the pool deletes and reads under kv/ is only its own (issue 53) ---------------------------------------
def prepared(tmp_path, model: str = "m") -> WarmSwap:
    binary, gguf = tmp_path / "llama-server", tmp_path / "model.gguf"
    for path in (binary, gguf):
        path.touch()
    ws = WarmSwap(str(tmp_path / "kv" / model), budget_mb=0, save_timeout_s=1)
    ws.prepare(str(binary), str(gguf), ["-c", "4096"])
    return ws


def test_prepare_deletes_only_config_directories_and_follows_no_link(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    root = tmp_path / "kv" / "m"
    (root / "0123456789abcdef").mkdir(parents=True)  # another config's: the pool's, deleted
    (root / "home").mkdir()  # not named as the pool names a config: left
    os.symlink(victim, root / "fedcba9876543210")  # named as one, but a link: left, and not followed
    ws = prepared(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == sorted(["home", "fedcba9876543210", ws.dir.name])
    assert (victim / "notes.txt").read_text() == "mine"
    # a kv/<model> that is itself a link: refused, nothing done in what it names
    os.symlink(victim, tmp_path / "kv" / "linked")
    with pytest.raises(OSError, match="symbolic link"):
        prepared(tmp_path, "linked")
    assert sorted(p.name for p in victim.iterdir()) == ["notes.txt"]


def test_trim_and_scans_touch_only_the_pools_regular_snapshots(tmp_path):
    ws = prepared(tmp_path)
    stranger = ws.dir / "stray.bin"  # not named as the pool's
    stranger.write_bytes(b"x" * 100)
    fifo = ws.dir / "2-0.bin"  # named as the pool's, but a FIFO: reading it would block
    os.mkfifo(fifo)
    fifo.with_suffix(".json").write_text("{}")
    unpaired = ws.dir / "3-0.bin"  # named as the pool's, with no sidecar: trim leaves it to the scans
    unpaired.write_bytes(b"x" * 100)
    ws.trim()  # budget 0: every snapshot of the pool's would go
    assert stranger.exists() and fifo.exists() and unpaired.exists()
    assert ws.snapshots() == []  # the FIFO and the unpaired file did not check out: deleted, not read
    assert stranger.read_bytes() == b"x" * 100 and not fifo.exists() and not unpaired.exists()
