"""RewardModelPool: a reward model (reward/model_scorer.py) in processes of its own, scoring batches.

    pool = RewardModelPool(cfg.reward, trainer_ranks=[0, 1])  # a folder that cannot be used fails here
    pool.submit(key, prompt_text, response_text)              # never blocks
    for key, score, info in pool.poll(): ...                  # never blocks (poll(timeout=s) may wait)
    pool.close()

Each of ``--reward.model-workers`` spawned processes loads the model once on
``--reward.model-device`` (cpu, or cuda:N: a GPU a trainer rank uses only with
``--reward.model-share-trainer-gpu``; checked in the worker, where CUDA may be touched), then
scores whatever is waiting when it is free, up to ``--reward.model-batch-size`` pairs in one
forward (dynamic batching: one pair when one is waiting). Failures follow RewardPool's rules
(reward/pool.py), so the run's reward-error handling sees them as any failed reward: a batch that
raises, returns a non-finite score, runs past ``--reward.timeout-s`` (its worker is killed and
replaced) or whose worker dies scores 0 with ``info["error"]`` ("reward model: ..."), each key
exactly once; a model that cannot be loaded is a RewardError from ``poll()`` (one line, the run
stops). Nothing is pickled but (id, [str], [str]) tuples and floats between the processes.
"""

from __future__ import annotations

import collections
import math
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection, wait

from staleflow.cluster.placement import gpu_of
from staleflow.reward.functions import RewardError
from staleflow.reward.model_scorer import check_reward_model_folder
from staleflow.reward.pool import _die_with_parent

_READY = "ready"


def check_device(device: str, trainer_gpus, share: bool, visible: int) -> None:
    """A one-line RewardError when ``device`` is not a GPU of this machine or is a trainer rank's."""
    if device == "cpu":
        return
    index = int(device.split(":", 1)[1])
    if index >= visible:
        raise RewardError(f"--reward.model-device={device}: this machine has {visible} GPUs: use cpu or cuda:0..")
    if index in trainer_gpus and not share:
        raise RewardError(
            f"--reward.model-device={device} is a trainer rank's GPU: choose a free GPU or cpu, or allow it "
            f"with --reward.model-share-trainer-gpu"
        )


def _worker_main(conn: Connection, cfg, trainer_ranks: list[int], index: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        os.environ["SPT_NOENV"] = "1"
        import setproctitle

        setproctitle.setproctitle(f"staleflow[reward-model {index}]")
    except ImportError:
        pass
    try:
        import torch

        from staleflow.reward.model_scorer import RewardModelScorer

        visible = torch.cuda.device_count() if cfg.model_device != "cpu" else 0
        trainer_gpus = {gpu_of(r, visible) for r in trainer_ranks} if visible else set()
        check_device(cfg.model_device, trainer_gpus, cfg.model_share_trainer_gpu, visible)
        torch.set_num_threads(max(1, torch.get_num_threads() // max(cfg.model_workers, 1)))
        scorer = RewardModelScorer(cfg.model, cfg.model_device, cfg.model_dtype, cfg.model_max_tokens)
    except Exception as e:
        conn.send(("init_error", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"))
        return
    conn.send((_READY, None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        batch_id, prompts, responses = job
        t0 = time.perf_counter()
        try:
            scores, error = scorer.score(prompts, responses), None
        except Exception as e:
            scores, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        conn.send((batch_id, scores, error, time.perf_counter() - t0))


class _Worker:
    def __init__(self, ctx, cfg, trainer_ranks: list[int], index: int):
        self.conn, child = ctx.Pipe()
        self.index = index
        self.proc = ctx.Process(
            target=_worker_main, args=(child, cfg, trainer_ranks, index), name="staleflow-reward-model", daemon=True
        )
        self.proc.start()
        child.close()
        self.ready = False
        self.batch: tuple[int, list] | None = None  # (batch id, [(key, prompt, response)]) in flight
        self.started = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardModelPool:
    """Non-blocking batched reward-model scoring: submit(key, prompt, response), poll() -> (key, score, info)."""

    def __init__(self, cfg, trainer_ranks=(), timeout_s: float | None = None):
        """trainer_ranks: the run's trainer ranks (their GPUs are the ones launch/dist.py gives them)."""
        check_reward_model_folder(cfg.model)  # a folder that cannot be used fails here, in the caller
        self.cfg = cfg
        self.trainer_ranks = sorted(trainer_ranks)
        self.timeout_s = cfg.timeout_s if timeout_s is None else timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, cfg, self.trainer_ranks, i) for i in range(cfg.model_workers)]
        self._queue: collections.deque[tuple[object, str, str]] = collections.deque()
        self._done: list[tuple[object, float, dict]] = []
        self._next_batch = 0
        self._closed = False
        self.counters = collections.Counter()

    def submit(self, key, prompt: str, response: str) -> None:
        if self._closed:
            raise RuntimeError("RewardModelPool.submit after close()")
        self.counters["submitted"] += 1
        self._queue.append((key, prompt, response))
        self._dispatch()

    def poll(self, timeout: float = 0.0) -> list[tuple[object, float, dict]]:
        """Finished (key, score, info) since the last poll; waits up to ``timeout`` s for the first one."""
        deadline = time.monotonic() + timeout
        while True:
            self._collect(max(0.0, min(deadline - time.monotonic(), 0.05)) if not self._done else 0.0)
            self._expire()
            self._dispatch()
            if self._done or time.monotonic() >= deadline or not self.pending():
                break
        out, self._done = self._done, []
        return out

    def pending(self) -> int:
        in_flight = sum(len(w.batch[1]) for w in self._workers if w.batch is not None)
        return len(self._queue) + in_flight + len(self._done)

    def close(self) -> None:
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

    def stats(self) -> dict:
        return {"model_workers": len(self._workers), "model_queued": len(self._queue), **self.counters}

    # ---- internals --------------------------------------------------------------------------
    def _finish(self, key, score: float, error: str = "", elapsed: float | None = None) -> None:
        self.counters["scored"] += 1
        info: dict = {"model_score": score, "elapsed_s": elapsed}
        if error:
            self.counters["errors"] += 1
            info["error"] = f"reward model: {error}"
        self._done.append((key, score, info))

    def _fail_batch(self, w: _Worker, why: str) -> None:
        _, items = w.batch
        w.batch = None
        for key, _, _ in items:
            self._finish(key, 0.0, why)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.counters["restarts"] += 1
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self.cfg, self.trainer_ranks, w.index)

    def _dispatch(self) -> None:
        for w in self._workers:
            if not (self._queue and w.ready and w.batch is None):
                continue
            items = [self._queue.popleft() for _ in range(min(len(self._queue), self.cfg.model_batch_size))]
            batch_id, self._next_batch = self._next_batch, self._next_batch + 1
            try:
                w.conn.send((batch_id, [p for _, p, _ in items], [r for _, _, r in items]))
            except (OSError, ValueError):  # the worker died: run the batch elsewhere
                self._queue.extendleft(reversed(items))
                self._replace(w)
                continue
            w.batch, w.started = (batch_id, items), time.monotonic()
            self.counters["batches"] += 1

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
                raise RewardError(f"the reward model --reward.model={self.cfg.model!r} cannot run: {msg[1]}")
            elif w.batch is not None and w.batch[0] == msg[0]:
                _, scores, error, elapsed = msg
                items, w.batch = w.batch[1], None
                for i, (key, _, _) in enumerate(items):
                    s = scores[i] if scores is not None and i < len(scores) else 0.0
                    bad = error or ("" if math.isfinite(s) else f"the score is {s}")
                    self._finish(key, 0.0 if bad else float(s), bad, elapsed)

    def _on_death(self, w: _Worker) -> None:
        w.proc.join(timeout=1.0)
        code = w.proc.exitcode
        if not w.ready:
            self.close()
            raise RewardError(f"the reward model's process died while loading {self.cfg.model!r} (exit code {code})")
        if w.batch is not None:
            self._fail_batch(w, f"its process died (exit code {code}) while scoring")
        self._replace(w)

    def _expire(self) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.batch is not None and now - w.started > self.timeout_s:
                self.counters["timeouts"] += 1
                self._fail_batch(w, f"timeout: a batch ran over {self.timeout_s:g} s (--reward.timeout-s)")
                self._replace(w)
