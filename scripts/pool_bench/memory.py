"""4. Memory: the supervisor's RSS idle and under load, and each worker's without its backend
child, as sections 1-3 record them (record()); this section prints their table."""

from __future__ import annotations

from pool_bench.bench import Bench
from pool_bench.children import PoolProc
from pool_bench.report import mib, table


def record(bench: Bench, label: str, pool: PoolProc, idle: int, peak: int | None) -> None:
    try:
        workers = pool.workers()
    except Exception as exc:
        bench.note(f"{label}: /admin/workers failed: {exc}")
        workers = []
    wrss = [w.get("rss_bytes") or 0 for w in workers]
    crss = [sum(c.get("rss_bytes") or 0 for c in w.get("children", [])) for w in workers]
    bench.memory_rows.append([label, mib(idle), mib(peak), len(workers),
                              " / ".join(mib(x) for x in wrss) or "-",
                              " / ".join(mib(x) if x else "none" for x in crss) or "-"])
    bench.out.setdefault("memory", []).append({"pool": label, "supervisor_idle": idle, "supervisor_peak": peak,
                                               "worker_rss": wrss, "backend_child_rss": crss})


def run(bench: Bench) -> None:
    if not bench.memory_rows:
        bench.emit("4. Memory", "No pool ran (sections 1-2 skipped or failed).")
        return
    text = table(["process", "supervisor RSS idle MiB", "supervisor RSS peak under load MiB", "workers",
                  "worker RSS MiB (without backend child)", "backend child RSS MiB"], bench.memory_rows)
    text += ("\n\nIdle: after start and a warm-up, before the measured load. Peak: sampled every 0.2 s "
             "during the measured rounds. Worker RSS and children from GET /admin/workers after the load.")
    bench.emit("4. Memory", text)
