"""The layer rule: imports point one way. The node side of Ray placement and the
worker run on hosts where the supervisor is not: they, `protocol` and `procutil`
import nothing of it; `procutil` and `protocol` import nothing of the project;
the scripts and their harness never import the tests."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import ROOT

PROJECT = {"protocol", "procutil", "runtime_worker", "node_host", "supervisor", "testkit", "tests"}
# what each may import of the project (itself always): the rule, not today's imports
ALLOWED = {
    "protocol": set(),
    "procutil": set(),
    "runtime_worker": {"protocol", "procutil"},
    "node_host": {"protocol", "procutil"},
    "supervisor": {"protocol", "procutil", "node_host"},
    "testkit": {"protocol", "procutil", "runtime_worker", "node_host", "supervisor"},
    "scripts": {"protocol", "procutil", "runtime_worker", "node_host", "supervisor", "testkit"},
}


def python_files(top: str) -> list[Path]:
    folder = ROOT / top
    files = list(folder.rglob("*.py"))
    if top == "scripts":  # the entry points have no suffix
        files += [p for p in folder.iterdir() if p.is_file() and p.suffix == "" and
                  p.read_text(errors="replace").startswith("#!/usr/bin/env python")]
    return files


def project_imports(path: Path) -> set[str]:
    """The project's top-level packages that `path` imports, anywhere in it (a
    function-level import counts as much as one at the top)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names} & PROJECT
    return found


@pytest.mark.parametrize("top", sorted(ALLOWED))
def test_each_layer_imports_only_what_lies_below_it(top):
    files = python_files(top)
    assert files, f"no Python files under {top}/"
    wrong = {f"{path.relative_to(ROOT)}: {sorted(bad)}" for path in files
             if (bad := project_imports(path) - ALLOWED[top] - {top})}
    assert not wrong, f"{top}/ imports what it must not: {sorted(wrong)}"


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The check above can fail: an import inside a function is found too."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from supervisor.replicas.observe import ProcessSampler\n    import tests.procs\n")
    assert project_imports(bad) == {"supervisor", "tests"}


@pytest.mark.parametrize("package", ["node_host.host", "runtime_worker.__main__", "procutil.tree",
                                     "procutil.sample"])
def test_a_node_side_import_loads_no_supervisor_module(package):
    """What runs on a Ray node (or in a worker), imported in a fresh interpreter,
    brings in no supervisor module (nor uvicorn or FastAPI with it)."""
    code = (f"import json, sys; import {package}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('supervisor', 'tests', 'testkit', 'fastapi', 'uvicorn'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
