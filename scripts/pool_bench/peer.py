"""3. A peer: LiteLLM's proxy (installed into its own venv under the user's cache dir) vs
llm-pool (openai_remote backend), both in front of the same llama-server and of a
synthetic-speed upstream: what each proxy adds per request and per token."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pool_bench import memory
from pool_bench.bench import Bench, synthetic_model
from pool_bench.children import CpuMeter, LlamaProc, PoolProc, Proc, RssSampler, wait_http
from pool_bench.interleave import interleaved
from pool_bench.load import load, pct, plain_call, streaming_call
from pool_bench.report import loadavg, mib, ms, num, per_1k_tokens, per_request_us, ratio, say, table
from procutil.net import free_port

CACHE_ROOT = Path(os.environ.get("LLM_POOL_CACHE")
                  or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-pool")
LITELLM_VENV = CACHE_ROOT / "bench-litellm-venv"


class LiteLLMUnavailable(Exception):
    pass


def dir_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def ensure_litellm(bench: Bench) -> tuple[str | None, str]:
    """The litellm CLI in its own venv under the cache dir; installed on first use."""
    exe = LITELLM_VENV / "bin" / "litellm"
    marker = LITELLM_VENV / ".bench-install.json"
    bench.out["litellm_install"] = None
    if exe.exists() and marker.exists():
        info = json.loads(marker.read_text())
        bench.out["litellm_install"] = (f"reused {LITELLM_VENV} (litellm {info.get('version')}; installed "
                                        f"earlier in {info['seconds']:.0f} s, {info['bytes'] / 2**20:.0f} MiB)")
        return str(exe), ""
    if bench.quick:
        return None, (f"LiteLLM is not installed in {LITELLM_VENV} yet and --quick does not install it "
                      "(about 1-2 minutes, ~700 MiB): run scripts/bench once without --quick")
    say(f"installing LiteLLM into {LITELLM_VENV} (one time; pip install 'litellm[proxy]')")
    shutil.rmtree(LITELLM_VENV, ignore_errors=True)
    LITELLM_VENV.parent.mkdir(parents=True, exist_ok=True)
    log = LITELLM_VENV.parent / "bench-litellm-install.log"
    t0 = time.monotonic()
    try:
        with open(log, "wb") as f:
            # run through Proc so that a Ctrl-C or an error stops pip too
            for argv in ([sys.executable, "-m", "venv", str(LITELLM_VENV)],
                         [str(LITELLM_VENV / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                          "litellm[proxy]"]):
                f.write(f"$ {' '.join(argv)}\n".encode())
                f.flush()
                p = Proc("litellm-install", argv, log)
                try:
                    rc = p.popen.wait(900)
                except subprocess.TimeoutExpired:
                    p.stop(5)
                    raise RuntimeError("timed out after 900 s")
                p.stop(5)
                if rc != 0:
                    raise RuntimeError(f"{argv[2] if len(argv) > 2 else argv[0]} exited with {rc}")
    except Exception as exc:
        tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
        shutil.rmtree(LITELLM_VENV, ignore_errors=True)
        return None, f"could not install litellm[proxy] ({exc}); log {log}:\n```\n{tail}\n```"
    seconds = time.monotonic() - t0
    size = dir_size(LITELLM_VENV)
    version = subprocess.run([str(LITELLM_VENV / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('litellm'))"],
                             capture_output=True, text=True, timeout=120).stdout.strip()
    marker.write_text(json.dumps({"seconds": seconds, "bytes": size, "version": version}))
    bench.out["litellm_install"] = (f"installed now into {LITELLM_VENV}: litellm {version}, {seconds:.0f} s, "
                                    f"{size / 2**20:.0f} MiB")
    say(bench.out["litellm_install"])
    return str(exe), ""


def start_litellm(tmp: Path, exe: str, synth_upstream: str, llama: LlamaProc | None) -> Proc:
    port = free_port()
    lines = ["model_list:",
             "  - model_name: synth",
             "    litellm_params:",
             "      model: openai/synth",
             f"      api_base: {synth_upstream}/v1",
             "      api_key: unused"]
    if llama:
        lines += ["  - model_name: tiny",
                  "    litellm_params:",
                  "      model: openai/tiny",
                  f"      api_base: {llama.url}/v1",
                  f"      api_key: {llama.key}"]
    lines += ["litellm_settings:", "  telemetry: false", "  drop_params: true",
              "general_settings:", "  master_key: sk-bench"]
    cfg = tmp / "litellm.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", "DISABLE_SCHEMA_UPDATE": "True"}
    proc = Proc("litellm", [exe, "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
                            "--num_workers", "1"], tmp / "litellm.log", env=env)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def run(bench: Bench) -> None:
    if bench.args.skip_litellm:
        bench.emit("3. Peer: LiteLLM proxy", "Skipped (--skip-litellm).")
        return
    title = "3. Peer: LiteLLM proxy vs llm-pool (openai_remote) in front of the same upstreams"
    litellm_bin, why = ensure_litellm(bench)
    install = bench.out.get("litellm_install")
    if litellm_bin is None:
        bench.emit(title, f"Skipped: {why}")
        bench.note(f"section 3 skipped: {why}")
        return
    parts: list[str] = []
    if install:
        parts.append(f"LiteLLM venv: {install}")
    rows_stream, rows_plain, data = [], [], {"streaming": [], "plain": []}
    procs: list[Proc] = []
    load_before = loadavg()
    try:
        say("section 3: starting upstreams (llama-server, synthetic pool), llm-pool proxy and LiteLLM")
        llama = None
        tinies = [m for m in bench.llama_models() if m["name"] == "tiny"] if bench.binary else []
        if tinies:
            tiny = tinies[0]
            llama = LlamaProc(bench.tmp, "llama-upstream", bench.binary, tiny["path"], tiny["ctx"], 4,
                              [*tiny["args"], "--ignore-eos"])
            procs.append(llama)
        upstream = PoolProc(bench.tmp, "pool-upstream", [synthetic_model("synth", 64, 16)])
        procs.append(upstream)
        for p in procs:
            p.ready()
        proxy_models = [{"name": "synth", "backend": "openai_remote", "target_inflight": 64,
                         "max_queue": 1024,
                         "options": {"base_url": upstream.url + "/v1", "model": "synth"}}]
        env = {}
        if llama:
            proxy_models.append({"name": "tiny", "backend": "openai_remote", "target_inflight": 4,
                                 "max_queue": 256, "options": {
                                     "base_url": llama.url + "/v1", "model": "tiny",
                                     "api_key_env": "BENCH_LLAMA_KEY"}})
            env["BENCH_LLAMA_KEY"] = llama.key
        proxy = PoolProc(bench.tmp, "pool-proxy", proxy_models, env=env)
        procs.append(proxy)
        lite = start_litellm(bench.tmp, litellm_bin, upstream.url, llama)
        procs.append(lite)
        proxy.ready()
        try:
            wait_http(lite, lite.url + "/health/liveliness", 240)
        except RuntimeError as exc:
            raise LiteLLMUnavailable(f"LiteLLM proxy did not start: {exc}") from None
        lite_idle = lite.tree_rss()
        proxy_idle = proxy.rss()
        meters = {"llm-pool proxy": {"proxy": CpuMeter([proxy.pid, *(w["pid"] for w in proxy.workers()
                                                                   if w["pid"])])},
                  "LiteLLM proxy": {"proxy": CpuMeter([p.pid for p in lite.tree()])}}
        # non-streaming, synthetic upstream: what each proxy adds per request
        targets = {"upstream (llm-pool synthetic)": upstream.url, "llm-pool proxy": proxy.url,
                   "LiteLLM proxy": lite.url}
        for url in targets.values():
            load(plain_call(url, "synth", 16, "sk-bench"), 20, 2, 60, raw_url=url)
        concs = [1, 16]
        requests = 100 if bench.quick else 600
        rounds = 1 if bench.quick else 2

        def plain(t: str, c: int):
            return load(plain_call(targets[t], "synth", 16, "sk-bench"), requests, c, 6 if bench.quick else 15,
                        raw_url=targets[t])

        with RssSampler([lite.pid, proxy.pid]) as lite_sampler:
            res = interleaved(targets, concs, rounds, plain, meters, "synth", "req/s", alternate_per_conc=False)
        base = {c: pct(res[(next(iter(targets)), c)].latencies, 50) for c in concs}
        for c in concs:
            for t in targets:
                r = res[(t, c)]
                p50 = pct(r.latencies, 50)
                rps = r.done / r.wall if r.wall else None
                rows_plain.append([t, c, r.done, num(rps), ms(p50), ms(pct(r.latencies, 99)),
                                   "-" if t.startswith("upstream") or p50 is None else ms(p50 - base[c]),
                                   per_request_us(r, "proxy") if t in meters else "-", len(r.errors)])
                data["plain"].append({"target": t, "concurrency": c, "rps": rps, "p50": p50,
                                      "proxy_cpu_s": r.cpu_by.get("proxy"),
                                      "p99": pct(r.latencies, 99), "errors": len(r.errors)})
                if r.errors:
                    parts.append(f"- {t} c={c}: {len(r.errors)} errors, first: {r.errors[0]}")
        # streaming, llama-server upstream
        if llama:
            targets = {"llama-server direct": (llama.url, llama.key), "llm-pool proxy": (proxy.url, None),
                       "LiteLLM proxy": (lite.url, "sk-bench")}
            mt = 64 if bench.quick else 256
            for url, key in targets.values():
                load(streaming_call(url, "tiny", 8, key), 2, 1, 60)

            def streaming(t: str, c: int):
                url, key = targets[t]
                return load(streaming_call(url, "tiny", mt, key), 4 * c if bench.quick else 16 * c, c,
                            20 if bench.quick else 45)

            with RssSampler([lite.pid, proxy.pid]) as s2:
                res = interleaved(targets, (1, 4), rounds, streaming, meters, "tiny", "tok/s",
                                  alternate_per_conc=False)
            for c in (1, 4):
                d = res[("llama-server direct", c)]
                dt = d.tokens / d.wall if d.wall else None
                for t in targets:
                    r = res[(t, c)]
                    tps = r.tokens / r.wall if r.wall else None
                    rows_stream.append([t, c, r.done, num(tps), ratio(tps, dt), ms(pct(r.ttfts, 50)),
                                        ms(pct(r.ttfts, 95)),
                                        "-" if t.startswith("llama") or not r.ttfts else
                                        ms(pct(r.ttfts, 50) - pct(d.ttfts, 50)),
                                        per_1k_tokens(r, "proxy") if t in meters else "-", len(r.errors)])
                    data["streaming"].append({"target": t, "concurrency": c, "tok_s": tps,
                                              "proxy_cpu_s": r.cpu_by.get("proxy"), "tokens": r.tokens,
                                              "ttft_p50": pct(r.ttfts, 50), "errors": len(r.errors)})
                    if r.errors:
                        parts.append(f"- {t} c={c}: {len(r.errors)} errors, first: {r.errors[0]}")
            lite_peak = max(lite_sampler.peak.get(lite.pid, 0), s2.peak.get(lite.pid, 0))
            proxy_peak = max(lite_sampler.peak.get(proxy.pid, 0), s2.peak.get(proxy.pid, 0))
        else:
            lite_peak = lite_sampler.peak.get(lite.pid, 0)
            proxy_peak = lite_sampler.peak.get(proxy.pid, 0)
        memory.record(bench, "llm-pool proxy (openai_remote, 2 models)", proxy, proxy_idle, proxy_peak)
        bench.memory_rows.append(["LiteLLM proxy (process tree, no workers)", mib(lite_idle), mib(lite_peak),
                                 "-", "-", "-"])
        bench.out.setdefault("memory", []).append({"pool": "LiteLLM proxy (process tree)",
                                                  "supervisor_idle": lite_idle, "supervisor_peak": lite_peak,
                                                  "worker_rss": [], "backend_child_rss": []})
    except LiteLLMUnavailable as exc:
        bench.emit(title, f"Skipped: {exc}")
        bench.note(f"section 3 skipped: {str(exc)[:300]}")
        return
    finally:
        for p in reversed(procs):
            p.stop()
    bench.out["sections"]["litellm"] = data
    text = ""
    if rows_plain:
        text += ("Non-streaming, synthetic-speed upstream (an llm-pool with a synthetic model, 16 tokens); "
                 "added = p50 minus the upstream's own p50. Proxy CPU: llm-pool supervisor + workers, or the "
                 f"LiteLLM process tree. 1-min load average: {load_before} before, {loadavg()} after.\n\n")
        text += table(["target", "conc", "requests", "req/s", "p50 ms", "p99 ms", "added p50 ms",
                       "proxy CPU µs/req", "errors"], rows_plain)
    if rows_stream:
        text += ("\n\nStreaming from one llama-server (tiny GGUF, -np 4, --ignore-eos), all three in front "
                 "of the same server.\n\n")
        text += table(["target", "conc", "requests", "tok/s", "vs direct", "TTFT p50 ms", "TTFT p95 ms",
                       "TTFT p50 added ms", "proxy CPU ms/1k tok", "errors"], rows_stream)
    if parts:
        text += "\n\n" + "\n".join(parts)
    bench.emit(title, text)
