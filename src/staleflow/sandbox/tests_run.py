"""run_tests: a solution and its tests in the sandbox, with a verdict the solution cannot reach or forge.

    statements = split_tests(["assert add(1, 2) == 3", "assert add(0, 0) == 0"])
    r = run_tests("def add(a, b):\\n    return a + b\\n", statements, SandboxLimits(wall_s=15))
    r.passed, r.total, r.ok, r.reason, r.failure

The program is not "the solution followed by the tests" (whose exit status or output a solution can
fake: sys.exit(0) before the tests, a patched AssertionError, a printed marker). Inside one sandbox
two processes run (sandbox/harness.py has the steps): the harness, which never runs the solution's
code, runs every test statement in its own interpreter and calls the solution's functions through a
pipe, plain data each way (sandbox/wire.py); the solution runs in a fresh interpreter that holds
neither the tests, nor the per-run nonce, nor the verdict pipe, and cannot read the harness's memory
or file descriptors (the harness is non-dumpable). The harness writes one line per test, "NONCE I ok"
or "NONCE I fail WHY", then "NONCE end N", on a pipe only it holds; the run passes only when all N
tests, counted HERE from the row's tests, report ok with this run's nonce. A line without the nonce
is a forgery (``forged``). Exit status and output are not read. docs/sandbox.md says what this does
not cover.
"""

from __future__ import annotations

import ast
import secrets
from dataclasses import dataclass
from pathlib import Path

from staleflow.sandbox.bwrap import STALEFLOW_DIR
from staleflow.sandbox.limits import SandboxLimits, SandboxResult
from staleflow.sandbox.run import launch, outcome, runner_budget, unavailable

HERE = Path(__file__).parent
SCRIPTS = ("harness.py", "runner.py", "wire.py")
"""Our files placed read-only under /.staleflow inside the sandbox (standard library only)."""
MAX_STATEMENTS = 1000


@dataclass(frozen=True)
class TestsVerdict:
    """passed of total test statements reported ok by the harness; reason: the sandbox's (timeout,
    network, ...) or None; failure: the first failing test's line; forged: a verdict line without
    this run's nonce was found; error: the harness itself failed (a bug or an unusable sandbox)."""

    passed: int
    total: int
    reason: str | None
    failure: str
    forged: bool
    error: str | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.passed == self.total and not (self.reason or self.forged or self.error)


def split_tests(tests: list[str]) -> list[str]:
    """The row's tests as top-level statements, each one test (a statement that raises fails).
    ValueError (the row's fault) for tests that do not parse or hold no statement."""
    out: list[str] = []
    for text in tests:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            raise ValueError(f"the row's tests do not parse as Python ({type(e).__name__}: {e})") from None
        out += [ast.unparse(node) for node in tree.body]
    if not out:
        raise ValueError("the row's tests hold no statement")
    if len(out) > MAX_STATEMENTS:
        raise ValueError(f"the row's tests hold {len(out)} statements > {MAX_STATEMENTS}")
    return out


def run_tests(code: str, statements: list[str], limits: SandboxLimits) -> TestsVerdict | SandboxResult:
    """Run ``statements`` (split_tests) against ``code`` in the sandbox; a SandboxResult with
    reason "unavailable" when the sandbox cannot start (nothing ran)."""
    import json

    nonce = secrets.token_hex(16)
    job = json.dumps({"nonce": nonce, "tests": statements}).encode("utf-8", "surrogatepass")
    files = [("--file", "/sandbox/main.py", code.encode("utf-8", errors="surrogateescape"))]
    files += [("--ro-bind-data", f"{STALEFLOW_DIR}/{name}", (HERE / name).read_bytes()) for name in SCRIPTS]
    entry = [f"{STALEFLOW_DIR}/harness.py", "{verdict}", "{job}", "{reason}", runner_budget(limits)]
    run = launch(limits, files, entry, side=("reason", "verdict"), inherit=(("job", job),))
    if isinstance(run, SandboxResult):
        return run
    refused = unavailable(run)
    if refused is not None:
        return refused
    exit_code, reason = outcome(run)
    results, ended, forged, error = _read_verdict(run.side.get("verdict", ""), nonce)
    total = len(statements)
    passed = sum(1 for i in range(total) if results.get(i, ("", ""))[0] == "ok")
    failing = next((i for i in range(total) if results.get(i, ("", ""))[0] != "ok"), None)
    failure = ""
    if failing is not None:
        why = results.get(failing, ("", "no result"))[1] or "no result"
        failure = f"test {failing + 1}: {why}"
    if error is None and reason is None and ended != total and not forged:
        last = (run.out.text("stderr").strip().splitlines() or [f"exit {exit_code}"])[-1][:200]
        error = f"the harness gave no complete verdict ({last})"
    return TestsVerdict(
        passed, total, reason, failure, forged, error, run.out.text("stdout"), run.out.text("stderr"), run.wall_s
    )


def _read_verdict(text: str, nonce: str) -> tuple[dict[int, tuple[str, str]], int | None, bool, str | None]:
    """(test index -> (ok|fail, why), the end count, a forged line seen, the harness's error)."""
    results: dict[int, tuple[str, str]] = {}
    ended, forged, error = None, False, None
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if not secrets.compare_digest(head, nonce):
            forged = True
            continue
        word, _, tail = rest.partition(" ")
        if word == "end" and tail.isdigit():
            ended = int(tail)
        elif word == "error":
            error = f"harness: {tail[:200]}"
        elif word.isdigit() and tail.split(" ", 1)[0] in ("ok", "fail"):
            status, _, why = tail.partition(" ")
            results.setdefault(int(word), (status, why))
        else:
            forged = True
    return results, ended, forged, error
