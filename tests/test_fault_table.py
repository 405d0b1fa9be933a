"""The fault table (staleflow/faults.py): every kind's action and exit code, the ranks' and the
controller's handlers reading the same table, and a kind added by one entry (docs/recovery.md)."""

from __future__ import annotations

import errno
import signal
from types import SimpleNamespace

import pytest

from staleflow import faults
from staleflow.config import ConfigError
from staleflow.control.hub import FatalFailure, RankDied
from staleflow.control.messages import Failure
from staleflow.controller import LoopTimeout, RewardsFailing, Stalled
from staleflow.data import DataError
from staleflow.durable import DiskError
from staleflow.launch import entry
from staleflow.model.aliases import AliasError
from staleflow.model.hf import ModelLoadError
from staleflow.reward.functions import RewardError
from staleflow.runtime import process
from staleflow.train.checkpoint_files import CheckpointError

# (exception, its kind, the controller's exit code, its first line; "{e}" is the exception's text)
CASES = [
    (KeyboardInterrupt(), "signal", 130, "staleflow: interrupted; stopping the run"),
    (KeyboardInterrupt("stopped by SIGTERM"), "signal", 143, "staleflow: stopped by SIGTERM; stopping the run"),
    (ConfigError("--steps=0 is invalid"), "bad-input", 2, "staleflow: ConfigError: --steps=0 is invalid"),
    (DataError("row 3: no answer"), "bad-input", 2, "staleflow: DataError: row 3: no answer"),
    (ModelLoadError("bad header"), "bad-input", 2, "staleflow: ModelLoadError: bad header"),
    (AliasError("no package"), "bad-input", 2, "staleflow: AliasError: no package"),
    (RewardError("not a function"), "bad-input", 2, "staleflow: RewardError: not a function"),
    (CheckpointError("bad manifest"), "bad-input", 2, "staleflow: CheckpointError: bad manifest"),
    (FatalFailure("rank 1: DataError: x"), "bad-input", 2, "staleflow: FatalFailure: rank 1: DataError: x"),
    (RewardsFailing("32 reward calls"), "bad-input", 2, "staleflow: RewardsFailing: 32 reward calls"),
    (DiskError(errno.ENOSPC, "disk full"), "disk", 2, "staleflow: DiskError: disk full"),
    (OSError(errno.EROFS, "Read-only"), "disk", 2, "staleflow: OSError: [Errno 30] Read-only"),
    (OSError(errno.EFBIG, "File too large"), "disk", 2, "staleflow: OSError: [Errno 27] File too large"),
    (RankDied("rank 2 (rollout instance 0) died unexpectedly", rank=2), "rank-lost", 1, None),
    (Stalled("no step for 3 s"), "stalled", 1, "staleflow: controller error: Stalled: no step for 3 s"),
    (RuntimeError("a bug"), "bug", 1, "staleflow: controller error: RuntimeError: a bug"),
    (LoopTimeout("the wait"), "bug", 1, "staleflow: controller error: LoopTimeout: the wait"),
    (
        OSError(errno.ECONNRESET, "reset"),
        "bug",
        1,
        "staleflow: controller error: ConnectionResetError: [Errno 104] reset",
    ),
]


def _id(case) -> str:
    return f"{case[1]}-{type(case[0]).__name__}"


def test_every_table_kind_has_a_case_here():
    """A kind added to the table without a case in this file fails here (one entry + its test)."""
    assert {k.name for k in faults.TABLE} == {c[1] for c in CASES}
    assert faults.TABLE[-1].cls is BaseException, "the last entry must catch everything"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_each_fault_gets_its_kind_and_action(case):
    e, kind, code, _ = case
    k = faults.fault_kind(e)
    assert k.name == kind
    want = {
        "signal": faults.SAVE_THEN_STOP,
        "bad-input": faults.FATAL,
        "disk": faults.FATAL,
        "rank-lost": faults.SAVE_THEN_RESTART,
        "stalled": faults.RESTART,
        "bug": faults.RESTART,
    }[kind]
    assert k.action is want
    assert faults.no_restart_helps(e) == (want is faults.FATAL)


class _FakeHub:
    """What controller_main touches of the hub, recorded (no sockets, no ranks)."""

    def __init__(self, **kw):
        self.kw = kw
        self.server = SimpleNamespace(tcp_endpoint="")
        self.stop_requested, self.stop_at, self.shutdowns, self.closed = "", 0.0, [], False

    def wait_ready(self, timeout_s):
        pass

    def shutdown(self, reason, ok, wait_s=10.0, restart=False):
        self.shutdowns.append((reason, ok, restart))

    def close(self):
        self.closed = True


def _run_controller(monkeypatch, error: BaseException, signum: int = signal.SIGINT):
    """controller_main with a job that raises ``error``: (exit code, stderr lines, Shutdown, fatal mark)."""
    hubs, marks = [], []
    monkeypatch.setattr(process, "Hub", lambda **kw: hubs.append(_FakeHub(**kw)) or hubs[-1])
    monkeypatch.setattr(process, "mark_fatal", marks.append)

    def job(ctl, cfg):
        if isinstance(error, KeyboardInterrupt):  # how a signal arrives: the handler, then the exception
            signal.getsignal(signum)(signum, None)
        raise error

    cfg = SimpleNamespace(rollout=SimpleNamespace(ranks=1), fault=SimpleNamespace(remote_lost_s=7.0), smoke=False)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as out:
            process.controller_main(cfg, "faulttable", 2, 1, job=job)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    (hub,) = hubs
    assert hub.closed and hub.kw["remote_lost_s"] == 7.0  # --fault.remote-lost-s reaches the hub
    return out.value.code, hub.shutdowns, marks


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_controller_and_the_ranks_answer_from_the_same_table(monkeypatch, capsys, case):
    e, kind, code, line = case
    signum = signal.SIGTERM if code == 143 else signal.SIGINT
    got, shutdowns, marks = _run_controller(monkeypatch, e, signum)
    err = capsys.readouterr().err.splitlines()
    assert got == code
    assert err[0] == (line or f"staleflow: {e}; stopping the run")
    (reason, ok, restart), action = shutdowns[-1], faults.fault_kind(e).action
    assert not ok and restart == action.restart
    assert reason == {"signal": "interrupted", "rank-lost": str(e)}.get(kind, f"controller error: {e}")
    assert marks == ([f"{type(e).__name__}: {e}"] if action is faults.FATAL else [])

    sent = []
    client = SimpleNamespace(send=lambda msg, timeout_s=None: sent.append(msg))
    try:
        raise e
    except BaseException as raised:  # as the rank's loop sees it: with a traceback
        said = entry.report_failure(raised, client, rank=3)
    traceback_printed = "Traceback" in capsys.readouterr().err
    if kind == "signal":  # a signal is not this rank's failure: nothing sent, exit 1 (the controller decides)
        assert sent == [] and said.code == 1 and not traceback_printed
        return
    (failure,) = sent
    assert isinstance(failure, Failure) and failure.rank == 3 and failure.error == f"{type(e).__name__}: {e}"
    # the same verdict on both sides: fatal (exit 2, no restart) <=> the rank says fatal and exits 0
    assert failure.fatal == (code == 2) == (said.code == 0) == (not restart)
    assert traceback_printed == (not failure.fatal)


class _NewFault(RuntimeError):
    """A fault kind the table does not know yet."""


def test_a_kind_added_by_one_entry_changes_both_handlers(monkeypatch, capsys):
    e = _NewFault("quota exhausted")
    assert faults.fault_kind(e).name == "bug"
    monkeypatch.setattr(faults, "TABLE", (faults.Kind("quota", _NewFault, faults.FATAL), *faults.TABLE))
    assert faults.fault_kind(e).name == "quota"
    code, shutdowns, marks = _run_controller(monkeypatch, e)
    assert code == 2 and shutdowns[-1][2] is False and marks == ["_NewFault: quota exhausted"]
    assert capsys.readouterr().err.splitlines()[0] == "staleflow: _NewFault: quota exhausted"
    sent = []
    said = entry.report_failure(e, SimpleNamespace(send=lambda m, timeout_s=None: sent.append(m)), rank=1)
    assert sent[0].fatal and said.code == 0


def test_before_any_process_group_bad_input_is_one_line_and_exit_2():
    assert faults.start_outcome(ConfigError("--steps=0 is invalid")) == (
        "staleflow: config error: --steps=0 is invalid",
        2,
    )
    assert faults.start_outcome(ModelLoadError("config.json: bad field")) == ("staleflow: config.json: bad field", 2)
    assert faults.start_outcome(RuntimeError("a bug")) is None  # propagates with its traceback


def test_error_classes_declare_their_kind_by_subclassing_and_the_table_imports_none_of_them():
    """faults.py imports no package that raises its faults (it once imported eight, lazily)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(faults.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("staleflow")} == {"staleflow.durable"}
    for cls in (ConfigError, DataError, ModelLoadError, AliasError, CheckpointError, FatalFailure, RewardsFailing):
        assert issubclass(cls, faults.BadInput)
    assert issubclass(RankDied, faults.RankLost) and issubclass(Stalled, faults.Stuck)


def test_the_job_saves_first_for_exactly_the_save_first_kinds():
    """``save_first`` is acted on by the training job (runtime/job.py): the exceptions whose handler
    there calls save_before_stop are exactly those of the kinds whose action saves first."""
    import ast
    import builtins
    from pathlib import Path

    from staleflow.runtime import job

    saving = set()
    for node in ast.walk(ast.parse(Path(job.__file__).read_text())):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            calls = {getattr(c.func, "attr", "") for c in ast.walk(node) if isinstance(c, ast.Call)}
            if "save_before_stop" in calls:
                types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
                saving |= {getattr(job, t.id, None) or getattr(builtins, t.id) for t in types}
    assert saving and all(faults.fault_kind(cls("x")).action.save_first for cls in saving)
    first = {k.cls for k in faults.TABLE if k.action.save_first}
    assert all(any(issubclass(c, k) for c in saving) for k in first)
