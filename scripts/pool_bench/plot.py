"""bench.png: the sections' figures in one picture (needs the bench extra: matplotlib)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def plot(out: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no plot"
    s1 = out["sections"].get("streaming") or []
    s2 = out["sections"].get("capacity") or []
    s3 = (out["sections"].get("litellm") or {}).get("plain") or []
    mem = out.get("memory") or []
    fig, axes = plt.subplots(2, 3, figsize=(18, 9.5))

    def empty(ax, title: str) -> None:
        ax.set_title(title)
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="#888")
        ax.set_xticks([])
        ax.set_yticks([])

    models = list(dict.fromkeys(r["model"] for r in s1))
    for ax, key, title, scale in ((axes[0][0], "tok_s", "1. streaming tokens/s (llama-server)", 1),
                                  (axes[0][1], "ttft_p50", "1. time to first token p50 (ms)", 1000)):
        if not s1:
            empty(ax, title)
            continue
        for model in models:
            rows = [r for r in s1 if r["model"] == model]
            cs = [r["concurrency"] for r in rows]
            line = ax.plot(cs, [(r[f"direct_{key}"] or 0) * scale for r in rows], "o-", label=f"{model} direct")
            ax.plot(cs, [(r[f"pool_{key}"] or 0) * scale for r in rows], "s--", color=line[0].get_color(),
                    label=f"{model} pool")
        ax.set(title=title, xlabel="concurrency", xticks=[1, 2, 4])
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    for ax, keys, title in ((axes[1][0], ("bare_rps", "pool_rps"), "2. non-streaming requests/s"),
                            (axes[1][1], ("bare_p50", "pool_p50"), "2. non-streaming latency p50 (ms)")):
        if not s2:
            empty(ax, title)
            continue
        cs = [r["concurrency"] for r in s2]
        scale = 1000 if keys[0].endswith("p50") else 1
        ax.plot(cs, [(r[keys[0]] or 0) * scale for r in s2], "o-", label="bare FastAPI (ceiling)")
        ax.plot(cs, [(r[keys[1]] or 0) * scale for r in s2], "s--", label="pool, synthetic backend")
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        if scale == 1000:
            ax.set_yscale("log")
        ax.set(title=title, xlabel="concurrency")
        ax.legend(fontsize=8)
    ax = axes[0][2]
    title = "3. p50 latency, synthetic upstream (ms)"
    if s3:
        labels = [f"{r['target'].split(' (')[0]}\nc={r['concurrency']}" for r in s3]
        ax.bar(range(len(s3)), [(r["p50"] or 0) * 1000 for r in s3],
               color=["#888" if r["target"].startswith("upstream") else "#1f77b4" if "pool" in r["target"]
                      else "#d62728" for r in s3])
        ax.set_xticks(range(len(s3)), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(title)
    else:
        empty(ax, title)
    ax = axes[1][2]
    title = "4. supervisor (LiteLLM: whole proxy) RSS (MiB)"
    if mem:
        xs = range(len(mem))
        ax.bar([x - 0.2 for x in xs], [(m["supervisor_idle"] or 0) / 2**20 for m in mem], 0.4, label="idle")
        ax.bar([x + 0.2 for x in xs], [(m["supervisor_peak"] or 0) / 2**20 for m in mem], 0.4, label="peak under load")
        ax.set_xticks(list(xs), [m["pool"].replace(" (", "\n(") for m in mem], fontsize=7)
        ax.set_xlim(-0.9, len(mem) - 0.1)
        ax.set_title(title)
        ax.legend(fontsize=8)
    else:
        empty(ax, title)
    fig.suptitle(f"llm-pool bench {time.strftime('%Y-%m-%d %H:%M')} ({platform.node()}, "
                 f"{os.cpu_count()} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
