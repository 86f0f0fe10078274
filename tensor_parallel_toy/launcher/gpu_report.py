"""What a `gpu-check` run says (gpu_check.py runs the steps): each test step's JUnit report and
each step's log read into the lines worth pasting back, and the summary block built from the
steps' outcomes. Nothing here starts a process."""
import dataclasses
import os
import re
import xml.etree.ElementTree as ElementTree

PROG = "python -m tensor_parallel_toy gpu-check"


@dataclasses.dataclass
class Tests:
    counts: str = ""  # ", N passed, M failed, K skipped", or "" without a report
    backend_passed: int = 0  # tests parametrized with the step's backend that passed
    failures: list = dataclasses.field(default_factory=list)  # "test: cause" per failed test
    skip_reasons: list = dataclasses.field(default_factory=list)


def _one_line(text, most=400):
    """The first line of a message, its exception named without its module path."""
    line = re.sub(r"^(?:\w+\.)+(?=\w+: )", "", " ".join((text or "").strip().splitlines()[:1]))
    return line if len(line) <= most else line[:most - 3] + "..."


def read_report(report, backend=None):
    """What a JUnit report says (a `Tests`): the counts, how many tests parametrized with
    `backend` (an id part, as in test_x[nccl] or test_y[nccl-2]) passed, each failed test with
    the first line of its failure (pytest's "Type: message", which for a rank's error names
    the rank and its cause), and the distinct skip reasons."""
    try:
        root = ElementTree.parse(report).getroot()
    except (OSError, TypeError, ElementTree.ParseError):
        return Tests()
    found = Tests()
    totals = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    for case in root.iter("testcase"):
        name = case.get("name", "")
        ids = re.findall(r"\[(.*)\]$", name)
        node = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{name}"
        outcome = next((child for child in case if child.tag in ("failure", "error",
                                                                 "skipped")), None)
        if outcome is None:
            totals["passed"] += 1
            found.backend_passed += bool(backend and ids and backend in ids[0].split("-"))
        elif outcome.tag == "skipped":
            totals["skipped"] += 1
            reason = _one_line(outcome.get("message"))
            if reason not in found.skip_reasons:
                found.skip_reasons.append(reason)
        else:
            totals["failed" if outcome.tag == "failure" else "errors"] += 1
            found.failures.append(f"{node}: {_one_line(outcome.get('message'))}")
    parts = [f"{n} {word}" for word, n in totals.items() if n]
    found.counts = ", " + ", ".join(parts or ["0 tests"])
    found.skip_reasons = found.skip_reasons[:3]
    return found


def ranks_output(folder):
    """Where a step's ranks wrote their own stderr (`folder`), if any of them said anything."""
    files = sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else []
    return [f"ranks' own stderr: {folder}/ ({', '.join(files)})"] if files else []


def evidence(log_path, most=8):
    """A failed step's lines from its log, where there is no report to read: pytest's
    FAILED/ERROR lines or a step's own FAILED line, or else its last lines."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [line.rstrip() for line in f if line.strip()]
    picked = [line for line in lines if re.match(r"(FAILED|ERROR) ", line)]
    return (picked or lines[-3:])[:most]


def summary(outcomes, out, skipped=(), machine_line="", sharing="", rehearse=False):
    """The summary block: one line saying what passed, what failed and where the results are;
    then the failed steps, each with its failed tests and their causes; then the others."""
    bad = {status: [o.step.name for o in outcomes if o.status == status]
           for status in ("FAILED", "TIMED OUT", "not run")}
    ran = [o for o in outcomes if o.status != "not run"]
    passed = sum(o.status == "passed" for o in outcomes)
    head = (f"{PROG}{' --rehearse' if rehearse else ''}: {passed} of {len(outcomes)} steps "
            f"passed" + "".join(f"; {status}: {', '.join(names)}"
                                for status, names in bad.items() if names)
            + f"; results in {out}/ (summary.txt, a .log per step)")
    lines = [head]
    order = [o for o in ran if o.status != "passed"] + [o for o in outcomes if o not in ran
                                                        or o.status == "passed"]
    for o in order:
        seconds = f"{o.seconds:6.0f} s" if o.status != "not run" else " " * 8
        lines.append(f"  {o.status:<9} {o.step.name:<13} {seconds}  {o.detail}")
        lines += [f"      | {line}" for line in o.evidence]
    lines += [f"  {'skipped':<9} {name:<13} {'':>8}  {why}" for name, why in skipped]
    return "\n".join(lines + [line for line in (machine_line, sharing) if line]) + "\n"
