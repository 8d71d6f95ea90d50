"""llama.cpp's own server tests, run twice on the same model and flags: against a direct
llama-server and against the pool serving it. Prints both pass counts and the tests that pass
direct but not through the pool; --json FILE writes them too. scripts/test-llama-cpp calls this.
  run.py TESTS_DIR [--json FILE] [FILE...]   (FILEs relative to TESTS_DIR; default: FILES)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from testkit.llama import direct_llama_server
from testkit.pool import Pool
from testkit.tiny_gguf import write_tiny_gguf

HERE = Path(__file__).resolve().parent
# the upstream files whose tests a text model can take (no embeddings/rerank/vision model,
# no router/slots/LoRA/speculative server options: those need llama-server started their way)
FILES = ["unit/test_completion.py", "unit/test_chat_completion.py", "unit/test_stream.py",
         "unit/test_compat_oai_responses.py", "unit/test_tokenize.py", "unit/test_template.py",
         "unit/test_compat_anthropic.py"]
MODEL = "tiny"
# the upstream tinyllama2 preset's settings (2 slots, seed 42, temperature 0.8), on a bigger context
SLOTS, CTX = 2, 8192
EXTRA_ARGS = ["-b", "64", "-ub", "64", "--seed", "42", "--temp", "0.8"]
# model names the upstream tests send (the OpenAI client needs one): aliases of the one model
ALIASES = ["tinyllama-2", "test", "gpt-3.5-turbo", "gpt-3.5-turbo-instruct", "gpt-4.1", "davinci-002"]
TEST_TIMEOUT_S = 120


def run_tests(tests_dir: Path, files: list[str], port: int, out: Path, pool: bool) -> dict[str, str]:
    """One upstream pytest run against the server on `port`: {test id: passed|failed|skipped}."""
    env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port)}
    plugin = []
    if pool:
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        env["LLAMA_CPP_TIER_MODEL"] = MODEL
        plugin = ["-p", "llama_cpp_redirect"]
    junit = out.with_suffix(".xml")
    with open(out, "wb") as log:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
                        "--timeout", str(TEST_TIMEOUT_S), f"--junitxml={junit}", *files],
                       cwd=tests_dir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        results[f"{file}::{case.get('name')}"] = outcome
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("tests_dir", type=Path)
    parser.add_argument("files", nargs="*", default=FILES)
    parser.add_argument("--json", type=Path)
    args = parser.parse_intermixed_args()
    binary = os.environ["LLAMA_SERVER_BIN"]
    # a SIGTERM unwinds too, so the servers started here are stopped (their context managers)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ["LLAMA_SERVER_DEBUG_FAKE_TIMING"] = "1"  # as upstream starts its server, both runs
    tmp = Path(tempfile.mkdtemp(prefix="llm-pool-llama-cpp-tier-"))
    model = str(write_tiny_gguf(tmp / "tiny.gguf"))
    started = time.monotonic()
    flags = ["-c", str(CTX), "-np", str(SLOTS), *EXTRA_ARGS]
    (tmp / "pool").mkdir()
    pool = Pool(tmp / "pool", [{"name": MODEL, "backend": "llama_server", "target_inflight": SLOTS,
                                "aliases": ALIASES, "options": {"model": model, "binary": binary,
                                                                "ctx_size": CTX, "extra_args": EXTRA_ARGS}}])
    with direct_llama_server(binary, model, flags, tmp / "direct-server.log") as url:
        direct = run_tests(args.tests_dir, args.files, int(url.rsplit(":", 1)[1]), tmp / "direct.log", pool=False)
        pool.start(timeout=120)
        try:
            via_pool = run_tests(args.tests_dir, args.files, pool.port, tmp / "pool.log", pool=True)
            tests = sorted(set(direct) | set(via_pool))
            only_direct = [t for t in tests if direct.get(t) == "passed" and via_pool.get(t) != "passed"]
            if only_direct:  # once more through the pool: the tests sample, a chance draw is not a difference
                again = run_tests(args.tests_dir, only_direct, pool.port, tmp / "pool-again.log", pool=True)
                only_direct = [t for t in only_direct if again.get(t) != "passed"]
        finally:
            pool.stop()
    only_pool = [t for t in tests if via_pool.get(t) == "passed" and direct.get(t) != "passed"]
    report = {"tests": len(tests), "direct_passed": sum(v == "passed" for v in direct.values()),
              "pool_passed": sum(v == "passed" for v in via_pool.values()), "only_direct": only_direct,
              "only_pool": only_pool, "seconds": round(time.monotonic() - started, 1), "logs": str(tmp)}
    print(f"llama.cpp server tests ({len(tests)}): direct {report['direct_passed']} passed, "
          f"pool {report['pool_passed']} passed ({report['seconds']} s; logs in {tmp})")
    for t in only_direct:
        print("passes direct, fails through the pool:", t)
    for t in only_pool:
        print("passes through the pool, fails direct:", t)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
