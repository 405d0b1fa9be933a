"""Faults and what a run does about each: ONE table from exception to action, read by the ranks
(launch/entry.py) and the controller (runtime/process.py) alike. Pure: no torch, no I/O.

    kind = fault_kind(e)                       # the first TABLE entry whose class (and test) matches
    kind.action                                # RESTART / FATAL / SAVE_THEN_RESTART / SAVE_THEN_STOP
    said = controller_outcome(e, signum)       # the controller's line, Shutdown and exit code
    said = rank_outcome(e)                     # a rank's Failure, traceback or not, exit code

An error class declares its kind by subclassing a fault base of this module (``class
DataError(BadInput, ValueError)``), so nothing here imports the packages that raise them. Adding a
fault kind: a base class and one TABLE entry here, the error class where it is raised, a case in
tests/test_fault_table.py (docs/recovery.md, "The fault table").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from staleflow.durable import disk_problem


# ---- fault bases: an error class subclasses one to declare its kind ---------------------------------
class BadInput(Exception):
    """Bad input or a broken environment (config, data, model files, reward function, checkpoint):
    an elastic restart would fail the same way, so the run stops with one line and exit 2."""


class ConfigError(BadInput, ValueError):
    """A bad configuration value; the message names the flag, the value and the fix.

    Defined here (re-exported by staleflow.config) so that every layer can raise it without
    importing the config tree: the coordinator and the extension registries raise it too."""


class RankLost(RuntimeError):
    """A rank's process disappeared, stopped answering or reported a failure a restart may fix: the
    controller saves a checkpoint when the trainer is intact, then the run stops and restarts."""


class Stuck(RuntimeError):
    """The run made no progress for its stall limit: restart from the newest checkpoint."""


# ---- actions -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """What the run does about a fault. ``exit_code`` is the controller's (rank 0's) exit status; 0
    means 128 + the signal's number. ``restart``: an elastic restart may fix it (torchrun restarts the
    group from the newest checkpoint). ``save_first``: the training job saves a resumable checkpoint
    before stopping (runtime/job.py, when the trainer ranks are intact)."""

    name: str
    exit_code: int
    restart: bool
    save_first: bool = False


RESTART = Action("restart", exit_code=1, restart=True)
FATAL = Action("fatal", exit_code=2, restart=False)
SAVE_THEN_RESTART = Action("save-then-restart", exit_code=1, restart=True, save_first=True)
SAVE_THEN_STOP = Action("save-then-stop", exit_code=0, restart=False, save_first=True)


@dataclass(frozen=True)
class Kind:
    """One TABLE entry: exceptions of ``cls`` (for which ``test`` holds) get ``action``."""

    name: str
    cls: type[BaseException]
    action: Action
    test: Callable[[BaseException], bool] | None = None

    def matches(self, e: BaseException) -> bool:
        return isinstance(e, self.cls) and (self.test is None or self.test(e))


TABLE: tuple[Kind, ...] = (
    Kind("signal", KeyboardInterrupt, SAVE_THEN_STOP),  # SIGINT / SIGTERM (workers/rank.py raises it)
    Kind("bad-input", BadInput, FATAL),
    Kind("disk", OSError, FATAL, test=lambda e: disk_problem(e) is not None),  # full, read-only, EFBIG
    Kind("rank-lost", RankLost, SAVE_THEN_RESTART),
    Kind("stalled", Stuck, RESTART),
    Kind("bug", BaseException, RESTART),  # anything else: restart from the newest checkpoint
)
"""First match wins; the last entry catches everything."""


def fault_kind(e: BaseException) -> Kind:
    return next(k for k in TABLE if k.matches(e))


def no_restart_helps(e: BaseException) -> bool:
    """Whether an elastic restart would fail the same way (the run then stops with exit 2)."""
    return fault_kind(e).action is FATAL


# ---- what each side does, from the table -------------------------------------------------------------
@dataclass(frozen=True)
class ControllerOutcome:
    line: str
    """The one line the controller prints (stderr)."""
    reason: str
    """The Shutdown reason every rank receives."""
    restart: bool
    code: int
    fatal: bool
    """Mark the run failed on bad input (runfolder/elastic.mark_fatal): launch.sh exits 2, no restart."""


def controller_outcome(e: BaseException, signum: int = 2) -> ControllerOutcome:
    """The controller's answer to an exception out of its job (``signum``: the signal that stopped it)."""
    act = fault_kind(e).action
    if act is SAVE_THEN_STOP:
        return ControllerOutcome(
            f"staleflow: {str(e) or 'interrupted'}; stopping the run", "interrupted", False, 128 + int(signum), False
        )
    if act is SAVE_THEN_RESTART:
        return ControllerOutcome(f"staleflow: {e}; stopping the run", str(e), True, act.exit_code, False)
    said = f"{type(e).__name__}: {e}"
    if act is FATAL:
        return ControllerOutcome(f"staleflow: {said}", f"controller error: {e}", False, act.exit_code, True)
    return ControllerOutcome(
        f"staleflow: controller error: {said}", f"controller error: {e}", True, act.exit_code, False
    )


@dataclass(frozen=True)
class RankOutcome:
    reason: str
    """What the rank tells the controller (Failure.error / Goodbye.reason)."""
    report: bool
    """Send Failure to the controller (a signal is not a failure of this rank)."""
    fatal: bool
    """Failure(fatal=True): the controller stops the run without a restart."""
    traceback: bool
    """Print the traceback: an unexpected error; bad input is said in one line (by the controller)."""
    code: int
    """The rank's exit code: 0 after a fatal failure, so that torchrun does not restart the group
    (the controller marks the run and says why), else 1."""


def rank_outcome(e: BaseException) -> RankOutcome:
    """A rank's answer to an exception out of its loop (other than the controller's own RunStopped)."""
    act = fault_kind(e).action
    if act is SAVE_THEN_STOP:
        return RankOutcome(f"interrupted ({e})" if str(e) else "interrupted", False, False, False, 1)
    fatal = act is FATAL
    return RankOutcome(f"{type(e).__name__}: {e}", True, fatal, not fatal, 0 if fatal else 1)


def start_outcome(e: BaseException) -> tuple[str, int] | None:
    """Before any process group exists (parsing flags, building the model folder): the line and exit
    code for a fatal fault, None for anything else (it propagates)."""
    if fault_kind(e).action is not FATAL:
        return None
    return (f"staleflow: config error: {e}" if isinstance(e, ConfigError) else f"staleflow: {e}"), FATAL.exit_code
