"""Property-based HTTP fuzzing of the public endpoints from the app's own
OpenAPI document: whatever arrives, never a 5xx, and the pool keeps serving."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import synthetic


def test_public_endpoints_never_answer_5xx(make_pool):
    pool = make_pool([synthetic("syn", capacity=4, target_inflight=4)])
    st = Path(sys.executable).with_name("schemathesis")
    r = subprocess.run([str(st), "run", pool.url + "/openapi.json", "--checks", "not_a_server_error",
                        "--max-examples", "40", "--exclude-path-regex", "^/admin", "--seed", "1"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout.split("SUMMARY")[-1]
    ok = pool.http.post("/v1/responses", json={"model": "syn", "input": "after the fuzzing"})
    assert ok.status_code == 200
