"""A job's records each have one writer (scheduling/jobs.py): no module of the supervisor
but a record's writer assigns its fields, or gives a job that record; the job's own fields
that a module sets after its constructor have one writer each too. The records' fields are
their own `__slots__`, so a field added later is checked too; no other class of the
supervisor has an attribute of those names (the check would name it)."""

import ast
from pathlib import Path

from supervisor.admission.admit import DEFAULT_TENANT, Counted
from supervisor.replicas.worker_link import NOT_RUN, Run
from supervisor.scheduling.jobs import NOT_ADMITTED, NOT_ROUTED, Admitted, Job, Routing

ROOT = Path(__file__).resolve().parent.parent
# record class, the attribute of Job that holds it, its one writer, the module defining it
RECORDS = [
    (Admitted, "admitted", "supervisor/admission/admit.py", "supervisor/scheduling/jobs.py"),
    (Routing, "routing", "supervisor/scheduling/executor.py", "supervisor/scheduling/jobs.py"),
    (Run, "run", "supervisor/replicas/worker_link.py", "supervisor/replicas/worker_link.py"),
]
# fields on the job itself that one module sets after the constructor (the token path calls the first two)
JOB_FIELDS = {"meter": "supervisor/scheduling/fair_queue.py", "on_end": "supervisor/admission/admit.py",
              "counted": "supervisor/telemetry/metrics.py", "request_id": "supervisor/engine.py",
              "transcript": "supervisor/engine.py"}


def assignments(path: Path):
    """(line, attribute name, the class the assignment is in, the target's text) of every
    attribute assigned in the file."""
    found = []

    def visit(node, cls):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.ClassDef) else cls
            targets = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        found.append((child.lineno, sub.attr, cls, ast.unparse(sub)))
            visit(child, inner)
    visit(ast.parse(path.read_text()), None)
    return found


def test_only_its_writer_writes_a_record():
    wrong = []
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        for line, attr, cls, text in assignments(path):
            for record, slot, writer, home in RECORDS:
                if module == writer:
                    continue
                if attr in record.__slots__ and not (module == home and cls == record.__name__):
                    wrong.append(f"{module}:{line}: {text} (a field of {record.__name__}, written by {writer} alone)")
                if attr == slot and not (module == "supervisor/scheduling/jobs.py" and cls == "Job"):
                    wrong.append(f"{module}:{line}: {text} (job.{slot} is given by {writer} alone)")
            writer = JOB_FIELDS.get(attr)
            if writer and module != writer and not (module == "supervisor/scheduling/jobs.py" and cls == "Job"):
                wrong.append(f"{module}:{line}: {text} (set by {writer} alone)")
    assert not wrong, "\n".join(wrong)


def test_a_new_job_shares_the_defaults_and_admission_book_is_its_record():
    job = Job("m", {"messages": []}, 60)
    assert (job.admitted, job.routing, job.run) == (NOT_ADMITTED, NOT_ROUTED, NOT_RUN)
    # admission's book of a request is the job's record, whole from the start
    counted = Counted(DEFAULT_TENANT, None, "s", None)
    assert isinstance(counted, Admitted) and counted.session == "s"
    assert all(getattr(counted, name, "unset") is None for name in Admitted.__slots__ if name != "session")
    # the shared defaults still say nothing was decided (no writer changed one in place)
    assert all(getattr(NOT_ADMITTED, name) is None for name in Admitted.__slots__)
    assert (NOT_ROUTED.light, NOT_ROUTED.queue_reason) == (False, None)
    assert (NOT_RUN.replica, NOT_RUN.submitted_at, NOT_RUN.attempts, NOT_RUN.submit_seq,
            NOT_RUN.cancel_requested, NOT_RUN.runtime_tasks) == (None, None, 0, 0, False, None)
