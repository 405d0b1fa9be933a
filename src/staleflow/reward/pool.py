"""RewardPool: asynchronous reward scoring in worker processes, for the controller loop.

    pool = RewardPool(cfg.reward)                     # bad --reward.fn fails here
    pool.submit(key, completion_text, answer, meta)   # never blocks
    for key, reward, info in pool.poll():             # never blocks (poll(timeout=s) may wait)
        ...
    pool.close()

Why processes (``spawn``) and not threads: math-verify bounds its parsing/verification time with
``signal.alarm``, which only works in the main thread of a process, and a hung user function
cannot be stopped inside a thread. Each worker runs ``score`` in its own main thread, one job at
a time, with the next job already waiting in its pipe (PIPELINE). The pool times each job from
the moment its worker starts it and, past ``cfg.timeout_s``, kills that worker, reports reward 0
with ``info["error"]``, requeues the jobs that were waiting behind it and starts a replacement.
A raising function gives reward 0 with the error (see functions.score); a worker that dies
mid-job gives the same. Every submitted key comes back exactly once.

``workers=0`` scores inline inside ``submit`` (no processes, no timeout): for debugging.
Workers ignore SIGINT (the controller decides when to stop) and, on Linux, are killed when the
thread that created the pool dies, so create the pool in the controller's main thread.
"""

from __future__ import annotations

import collections
import ctypes
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection, wait

from staleflow.config import RewardConfig
from staleflow.reward.extract import last_boxed
from staleflow.reward.functions import RewardError, resolve_reward_fn, score

_READY = "ready"
PIPELINE = 2
"""Jobs in flight per worker: the next job waits in the worker's pipe, so it never idles between
two polls of the controller. Only the job at the head is running (and timed)."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the worker still exits when its pipe closes


def _worker_main(conn: Connection, fn_spec: str, format_weight: float, index: int = 0) -> None:
    """Worker loop: resolve the function once, then score jobs until told to stop (None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        os.environ["SPT_NOENV"] = "1"  # keep /proc/<pid>/environ readable (see workers/rank.set_title)
        import setproctitle

        setproctitle.setproctitle(f"staleflow[reward {index}]")
    except ImportError:  # a declared dependency; without it only the process title is lost
        pass
    try:
        fn = resolve_reward_fn(fn_spec)
        if fn_spec == "math":
            import math_verify  # noqa: F401  (pay the sympy import before the first timed job)
    except Exception as e:
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send((_READY, None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        job_id, completion, answer, meta = job
        reward, info = score(fn, completion, answer, meta, format_weight)
        conn.send((job_id, reward, info))


class _Worker:
    """One worker process and the job it is running (if any)."""

    def __init__(self, ctx, fn_spec: str, format_weight: float, index: int = 0):
        self.conn, child = ctx.Pipe()
        self.index = index
        self.proc = ctx.Process(
            target=_worker_main, args=(child, fn_spec, format_weight, index), name="staleflow-reward", daemon=True
        )
        self.proc.start()
        child.close()
        self.ready = False
        self.jobs: collections.deque[int] = collections.deque()  # job ids sent, in the order it runs them
        self.head_start = 0.0  # when jobs[0] started running

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    """Non-blocking reward scoring: submit(key, ...) now, poll() later for (key, reward, info)."""

    def __init__(self, cfg: RewardConfig, workers: int | None = None, timeout_s: float | None = None):
        resolve_reward_fn(cfg.fn)  # a bad name or import path fails here, in the caller
        self.cfg = cfg
        self.num_workers = cfg.workers if workers is None else workers
        if self.num_workers < 0:
            raise RewardError(f"RewardPool workers={self.num_workers} is invalid: must be >= 0 (0 = inline)")
        self.timeout_s = cfg.timeout_s if timeout_s is None else timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, cfg.fn, cfg.format_weight, i) for i in range(self.num_workers)]
        self._inline = resolve_reward_fn(cfg.fn) if self.num_workers == 0 else None
        self._queue: collections.deque[tuple[int, str, str, dict]] = collections.deque()
        self._keys: dict[int, object] = {}  # job id -> key, until the result is finished
        self._sent: dict[int, tuple[int, str, str, dict]] = {}  # jobs inside a worker, for requeueing
        self._done: list[tuple[object, float, dict]] = []
        self._next_id = 0
        self._closed = False
        self.counters = collections.Counter()

    # ---- public API -------------------------------------------------------------------------

    def submit(self, key, completion_text: str, answer: str, meta: dict | None = None) -> None:
        """Queue one completion for scoring; the key comes back from poll() exactly once."""
        if self._closed:
            raise RuntimeError("RewardPool.submit after close()")
        meta = {} if meta is None else meta
        self.counters["submitted"] += 1
        if self._inline is not None:
            reward, info = score(self._inline, completion_text, answer, meta, self.cfg.format_weight)
            self._finish(key, reward, info)
            return
        job_id, self._next_id = self._next_id, self._next_id + 1
        self._keys[job_id] = key
        self._queue.append((job_id, completion_text, answer, meta))
        self._dispatch()

    def poll(self, timeout: float = 0.0) -> list[tuple[object, float, dict]]:
        """Finished (key, reward, info) since the last poll; waits up to `timeout` s for the first one."""
        deadline = time.monotonic() + timeout
        while True:
            self._collect(max(0.0, min(deadline - time.monotonic(), 0.05)) if not self._done else 0.0)
            self._expire()
            self._dispatch()
            if self._done or time.monotonic() >= deadline or not self.pending():
                break
        out, self._done = self._done, []
        return out

    def drain(self, timeout: float) -> list[tuple[object, float, dict]]:
        """Poll until nothing is pending or `timeout` s passed; returns everything finished."""
        deadline, out = time.monotonic() + timeout, []
        while self.pending() and time.monotonic() < deadline:
            out += self.poll(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
        return out + self.poll()

    def pending(self) -> int:
        """Submitted keys not yet returned by poll (queued, running, or finished but not polled)."""
        return len(self._keys) + len(self._done)

    def close(self) -> None:
        """Stop the workers (jobs still pending are dropped; drain() first to keep them)."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.proc.join(timeout=1.0)
            w.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict:
        return {"workers": self.num_workers, "queued": len(self._queue), **self.counters}

    # ---- internals --------------------------------------------------------------------------

    def _finish(self, key, reward: float, info: dict) -> None:
        self.counters["scored"] += 1
        if info.get("error"):
            self.counters["errors"] += 1
        self._done.append((key, reward, info))

    def _fail_head(self, w: _Worker, why: str) -> None:
        """The running job of a worker about to be replaced scores 0; the jobs behind it are requeued."""
        job_id = w.jobs.popleft()
        completion = self._sent.pop(job_id)[1]
        self._finish(
            self._keys.pop(job_id),
            0.0,
            {
                "error": why,
                "answer_reward": 0.0,
                "format_reward": 0.0,
                "boxed": 1.0 if last_boxed(completion) is not None else 0.0,
                "elapsed_s": None,
            },
        )

    def _replace(self, w: _Worker) -> _Worker:
        for job_id in reversed(w.jobs):  # sent but not started: run them elsewhere, in order
            self._queue.appendleft(self._sent.pop(job_id))
        w.jobs.clear()
        w.kill()
        self.counters["restarts"] += 1
        fresh = _Worker(self._ctx, self.cfg.fn, self.cfg.format_weight, w.index)
        self._workers[self._workers.index(w)] = fresh
        return fresh

    def _dispatch(self) -> None:
        for w in self._workers:
            while self._queue and w.ready and len(w.jobs) < PIPELINE:
                job = self._queue.popleft()
                try:
                    w.conn.send(job)
                except (OSError, ValueError):  # the worker died: requeue, restart
                    self._queue.appendleft(job)
                    if w.jobs:
                        self._fail_head(w, "reward worker died while scoring")
                    self._replace(w)
                    break
                if not w.jobs:
                    w.head_start = time.monotonic()
                w.jobs.append(job[0])
                self._sent[job[0]] = job

    def _collect(self, timeout: float) -> None:
        by_conn = {w.conn: w for w in self._workers}
        for conn in wait(list(by_conn), timeout=timeout):
            w = by_conn[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self._on_death(w)
                continue
            if msg[0] == _READY:
                w.ready = True
            elif msg[0] == "init_error":
                self.close()
                raise RewardError(f"reward worker cannot load --reward.fn={self.cfg.fn!r}: {msg[1]}")
            else:
                job_id, reward, info = msg
                if w.jobs and w.jobs[0] == job_id:
                    w.jobs.popleft()
                    w.head_start = time.monotonic()
                    del self._sent[job_id]
                    self._finish(self._keys.pop(job_id), reward, info)

    def _on_death(self, w: _Worker) -> None:
        w.proc.join(timeout=1.0)
        code = w.proc.exitcode
        if not w.ready:
            self.close()
            raise RewardError(f"a reward worker for --reward.fn={self.cfg.fn!r} died while starting (exit code {code})")
        if w.jobs:
            self._fail_head(w, f"reward worker died (exit code {code}) while scoring")
        self._replace(w)

    def _expire(self) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.jobs and now - w.head_start > self.timeout_s:
                self.counters["timeouts"] += 1
                self._fail_head(w, f"timeout: reward function ran over {self.timeout_s:g} s (--reward.timeout-s)")
                self._replace(w)
