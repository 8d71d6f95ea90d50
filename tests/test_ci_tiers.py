"""The tiers and the main suite do not overlap: every tier marker (a test that needs what a
fresh machine lacks until its tier's script installs it) is left out of the main suite,
which scripts/test and scripts/test-newest both run, and .ci/run runs each tier. A tier
test that leaks into the main suite fails there under CI (it asks for its tier's script)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IN_MAIN_SUITE = {"llama", "gpu"}  # scripts/test installs llama-server; gpu tests skip without one


def markers() -> set[str]:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    return {line.split(":")[0].strip() for line in declared}


def main_suite_expression() -> str:
    out = subprocess.run(["bash", "-c", "source scripts/main-suite.sh && echo \"$MAIN_SUITE_MARKERS\""],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_every_tier_marker_is_left_out_of_the_main_suite_and_run_by_ci():
    tiers = markers() - IN_MAIN_SUITE
    assert tiers, "no tier markers declared"
    left_out = set(re.findall(r"not (\w+)", main_suite_expression()))
    assert left_out == tiers, f"main suite leaves out {sorted(left_out)}, tiers are {sorted(tiers)}"
    ci = (ROOT / ".ci" / "run").read_text()
    for tier in tiers:
        script = f"scripts/test-{tier.replace('_', '-')}"
        assert script in ci or f"-m {tier}" in ci, f".ci/run never runs the {tier} tier"


def test_both_main_suite_scripts_use_the_one_expression():
    for name in ("test", "test-newest"):
        text = (ROOT / "scripts" / name).read_text()
        assert "source scripts/main-suite.sh" in text and '-m "$MAIN_SUITE_MARKERS"' in text, name
