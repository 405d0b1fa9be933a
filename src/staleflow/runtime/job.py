"""The training job inside the controller process: the shared controller loop over the real ranks.

    TrainingJob(ctl, cfg).run()

Builds the prompt source, reward pool, staleness manager, coordinator and ledger, wires them to
the runtime backend (runtime/backend.py) and turns the loop (controller/loop.py) until --steps
versions exist, saving checkpoints between turns. The job adds what only a real run has: the
run folder (metrics.jsonl, trained.jsonl, TensorBoard, report.png), the progress line,
checkpoints with the controller's resume state, and the emergency checkpoint when a rollout
rank dies. Bytes never pass through here except to decode a finished response for its reward.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from staleflow.control.hub import RankDied
from staleflow.control.messages import Evaluated, Saved, SaveState
from staleflow.controller import Ledger, LoopTimeout, StepRecord
from staleflow.controller.build import build_loop
from staleflow.coordinator import load_cost_model
from staleflow.durable import DiskError
from staleflow.metrics.progress import ProgressDisplay
from staleflow.metrics.writer import MetricsWriter, save_config
from staleflow.runfolder.run_dir import read_ids, write_ids
from staleflow.runtime.backend import RuntimeBackend, RuntimeWorkload
from staleflow.runtime.evaluation import eval_line, gain_line


class TrainingJob:
    def __init__(self, ctl, cfg):
        from staleflow.data import Prompt, PromptSource
        from staleflow.model import load_tokenizer, resolve_model_path
        from staleflow.reward.functions import answer_problem
        from staleflow.reward.service import RewardService

        self.ctl, self.cfg, self.run_dir = ctl, cfg, ctl.run_dir
        s = cfg.staleness
        tokenizer = load_tokenizer(resolve_model_path(cfg.model.path))
        from staleflow.env import env_schemas  # a multi-turn run's prompts show its tools (docs/multi-turn.md)

        check = lambda a, meta: answer_problem(cfg.reward.fn, a, meta)  # noqa: E731
        self.source = PromptSource(cfg.data, tokenizer, check, env_schemas(cfg.env), cfg.env.tool_format)
        self.held_out = None
        if cfg.eval.n:  # set aside before any training prompt is drawn
            from staleflow.runtime.evaluation import HeldOutEval

            self.held_out = HeldOutEval(
                self.source.hold_out(cfg.eval.n),
                cfg.reward.fn,
                tokenizer,
                cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                with_env=bool(cfg.env.name),
            )
        self.rewards = RewardService(cfg.reward, ctl.roles.trainer_ranks)  # --reward.fn and/or --reward.model
        version = int(ctl.infos[0].get("version", 0))  # the trainer's version (resume)
        instances = [ctl.roles.instance_id(r) for r in ctl.roles.rollout_ranks]
        extra = ctl.infos[0].get("resume_extra") or {}
        ids = read_ids(self.run_dir)  # written every step: ids never repeat, even past the checkpoint
        ledger = Ledger(
            max(extra.get("next_traj", 0), ids.get("next_traj", 0)),
            max(extra.get("next_group", 0), ids.get("next_group", 0)),
        )
        self.writer = MetricsWriter(
            self.run_dir,
            tensorboard=cfg.log.tensorboard,
            wandb_project=cfg.log.wandb_project if cfg.log.wandb else "",
            config=dataclasses.asdict(cfg),
        )
        save_config(self.run_dir, cfg)
        self.backend = RuntimeBackend(ctl, cfg, tokenizer, self.rewards, self.writer)
        self.saved: Saved | None = None
        self.ticket = 0
        self.waiting_ticket: int | None = None
        self.writing: tuple[int, int, float] | None = None
        """(ticket, version, start) of the checkpoint being written in the background."""
        self.failure: BaseException | None = None
        self.workload = RuntimeWorkload(cfg, self.source)
        self.loop = build_loop(
            cfg.mode,
            s,
            cfg.coordinator,
            load_cost_model(cfg.coordinator.cost_model),
            instances,
            self.backend,
            self.workload,
            cfg.steps,
            version=version,
            ledger=ledger,
            peer=cfg.peer,  # the mode's own knobs (--peer.<mode>.<knob>)
            max_reward_failures=cfg.reward.max_consecutive_failures,
            refill_groups=cfg.train.dynamic_sampling_refill,
            on_step=self.log_step,
            listeners={Saved: self._on_saved, Evaluated: self._on_evaluated},
            counts=extra.get("counts", {}),
            requeue=[Prompt(**p) for p in extra.get("requeue", [])],  # in flight at the checkpoint: generated again
        )
        self.view = self.loop.view
        """All the job reads of the loop; it drives the loop with ``self.loop.run`` only."""
        self.progress = ProgressDisplay(cfg.steps, bar=cfg.log.progress, start=version)
        self.longest_step_s = 0.0
        self.stall_limit_s = 0.0
        self._size_stall_limit()
        self._last_log = (time.monotonic(), 0, 0)  # time, tokens generated, samples at the previous step
        self.samples = 0
        self.save_due = False
        if extra:
            self.source.load_state_dict(extra["data"])

    # ---- steps -------------------------------------------------------------------------------
    def log_step(self, rec: StepRecord, metrics: dict) -> None:
        """The loop finished a step: audit trail, metrics row, progress line; maybe a checkpoint."""
        for g in rec.groups:
            p = rec.prompts[g.group_id]
            self.writer.log_trained(
                rec.version,
                g.group_id,
                g.traj_version,
                g.traj_ids,
                g.rewards,
                prompt=p.text,
                answer=p.answer,
                sample=rec.samples.get(g.group_id, ""),
                prompt_id=p.prompt_id,
                content=rec.train.content.get(g.group_id, []),
                n_tokens=g.n_tokens,
                token_versions=rec.train.token_versions.get(g.group_id, []),
                **self._submitted(p.prompt_id),
            )
        now = time.monotonic()
        tokens = self.view.tokens_generated
        t_prev, tok_prev, n_prev = self._last_log
        self.samples += metrics["trained_trajectories"]
        dt = max(now - t_prev, 1e-6)
        ev = rec.train
        row = {
            **metrics,
            "tokens_per_s": (tokens - tok_prev) / dt,
            "samples_per_s": (self.samples - n_prev) / dt,
            "train_s": ev.train_s,
            "push_s": ev.push_s,
            "train": ev.metrics,
            **self.backend.traffic_row(),
        }
        if self.view.first_reward_error:
            row["reward_first_error"] = self.view.first_reward_error
        self._last_log = (now, tokens, self.samples)
        self.longest_step_s = max(self.longest_step_s, rec.t_done - rec.t_start)
        self._size_stall_limit()
        self.writer.log_step(rec.version, row)
        write_ids(self.run_dir, *self.view.ids())
        self.progress.update(rec.version, row)  # metrics.jsonl's step number
        k = self.cfg.eval.every
        if self.held_out is not None and k and ev.version % k == 0 and ev.version < self.cfg.steps:
            self.start_eval(ev.version)
        every = self.cfg.checkpoint.every
        self.save_due = bool(every) and ev.version % every == 0 and ev.version < self.cfg.steps  # holds training

    def _submitted(self, prompt_id: int) -> dict:
        """trained.jsonl's submitted_s: when the loop drew the prompt, in the run's seconds (absent
        for a prompt requeued on resume, drawn before the restart)."""
        t = self.workload.submitted.pop(prompt_id, None)
        return {} if t is None else {"submitted_s": round(t - self.writer.t_start, 4)}

    def _size_stall_limit(self) -> None:
        """The hub's stuck-rank limit (--fault.stall-s, or 4 x the longest step with a floor) and,
        three times that, the loop's own stall check (no finish and no step anywhere)."""
        self.stall_limit_s = self.ctl.stall_s = self.cfg.fault.limit(self.longest_step_s)

    # ---- held-out evaluation -----------------------------------------------------------------
    def start_eval(self, step: int) -> None:
        self.held_out.start(step, self.ctl.roles.rollout_ranks, self.ctl.send)

    def _on_evaluated(self, msg: Evaluated) -> None:
        """A held-out answer (a loop event); the evaluation is logged once all of its answers are in."""
        row = self.held_out.on_answer(msg, self.backend) if self.held_out is not None else None
        if row is not None:
            step = row.pop("step")
            self.writer.log_eval(step, row)
            print(eval_line(step, row), flush=True)

    def final_eval(self, timeout_s: float = 900.0) -> None:
        """Every instance loads the final weights, then answers the held-out set once more."""
        loop, view = self.loop, self.view
        try:
            loop.run(
                until=lambda: not view.syncing, timeout_s=timeout_s, what="the final weight load", pull=view.version
            )
            self.start_eval(view.version)
            loop.run(until=lambda: not self.held_out.running, timeout_s=timeout_s, what="the final evaluation")
        except LoopTimeout as e:
            print(f"staleflow: warning: {e}", file=sys.stderr, flush=True)
        first, last = (
            self.held_out.results[0] if self.held_out.results else None,
            self.held_out.results[-1] if self.held_out.results else None,
        )
        if first is not None and last is not None and last is not first:
            print(gain_line(first, last), flush=True)

    # ---- checkpoints -------------------------------------------------------------------------
    def resume_state(self) -> dict:
        next_traj, next_group = self.view.ids()
        return {
            "version": self.view.version,
            "data": self.source.state_dict(),
            "requeue": [dataclasses.asdict(p) for p in self.view.live_prompts()],
            "counts": self.view.counts(),
            "next_group": next_group,
            "next_traj": next_traj,
        }

    def save(
        self,
        export: bool,
        timeout_s: float = 600.0,
        final: bool = False,
        durable: bool | None = None,
        stopping: bool = False,
    ) -> bool:
        """Checkpoint collectively on the trainer ranks; events keep flowing into the loop meanwhile.

        A periodic save with --checkpoint.async-save returns once the trainers have copied their
        state to host memory (training goes on while they write; the outcome arrives later, see
        ``_on_late_saved``); a final save, a save before a stop, or any save without async waits
        until the checkpoint is in place, as long as the trainer leader estimates the write takes.
        A failed periodic save (disk full, a write error) is reported and the run goes on: the
        previous checkpoint is untouched. A failed final save fails the run."""
        t0 = time.time()
        self.save_due = False
        assert not self.view.training, "a checkpoint is taken between two steps"
        if durable is None:
            durable = final or export or not self.cfg.checkpoint.async_save
        export_dir = os.path.join(self.run_dir, "hf") if export else ""
        self.saved = None
        self.ticket += 1
        self.waiting_ticket = self.ticket
        self.ctl.broadcast(
            SaveState(
                step=self.view.version,
                extra=self.resume_state(),
                export_dir=export_dir,
                durable=durable,
                ticket=self.ticket,
            ),
            ranks=self.ctl.roles.trainer_ranks,
        )
        try:
            self._wait_saved(timeout_s)
            if self.saved.pending and durable:  # the state is copied; now the files (as long as they take,
                # unless the run is stopping: then the ranks' grace is the limit)
                limit = timeout_s if stopping else max(timeout_s, 2.0 * self.saved.estimate_s)
                self.saved = None
                self._wait_saved(limit)
        finally:
            self.waiting_ticket = None
        saved = self.saved
        if saved.pending:
            self.writer.log_span(0, "checkpoint_snapshot", t0, time.time())
            self.writing = (saved.ticket, saved.step, t0)
            return True
        self.writer.log_span(0, "checkpoint", t0, time.time())
        if saved.step != self.view.version and not saved.error:
            raise RuntimeError(
                f"the trainer saved version {saved.step}, the controller's resume state is for {self.view.version}"
            )
        return self._outcome(saved, final)

    def _wait_saved(self, timeout_s: float) -> None:
        try:
            self.loop.run(  # the checkpoint holds exactly this version: no buffer is consumed meanwhile
                until=lambda: self.saved is not None,
                timeout_s=timeout_s,
                what="the trainer's checkpoint",
                hold_training=True,
            )
        except LoopTimeout as e:
            raise RuntimeError(str(e)) from None

    def _outcome(self, saved: Saved, final: bool) -> bool:
        if saved.error:
            msg = f"checkpoint of version {saved.step} failed ({saved.error}); the previous checkpoint is still valid"
            if saved.disk:  # no retry or restart makes room: stop with the last checkpoint intact
                import errno

                raise DiskError(
                    errno.ENOSPC,
                    f"{msg}; stopping: free space (or make the run folder writable) and "
                    f"resume with --resume {self.run_dir}",
                )
            if final:
                raise RuntimeError(msg)
            print(f"staleflow: warning: {msg}; the run goes on", file=sys.stderr, flush=True)
            return False
        return True

    def _on_saved(self, msg: Saved) -> None:
        if self.waiting_ticket is not None and msg.ticket == self.waiting_ticket:
            self.saved = msg
        else:
            self._on_late_saved(msg)

    def _on_late_saved(self, msg: Saved) -> None:
        """The outcome of a background write (its save() returned after the snapshot). A failure is
        a warning, a full disk stops the run (raised by the job's main loop)."""
        ticket, _, t0 = self.writing or (None, msg.step, time.time())
        if ticket == msg.ticket:
            self.writing = None
            self.writer.log_span(0, "checkpoint_write", t0, time.time())
        try:
            self._outcome(msg, final=False)
        except DiskError as e:
            self.failure = e

    def save_before_stop(self, why: str, grace_s: float = 18.0) -> None:
        """The run is stopping (a rank died, a signal): finish the running step and save a
        resumable checkpoint, within the grace the trainer ranks keep after their SIGTERM."""
        self.ctl.grace_s = grace_s + 2.0  # a stop request waits this long: the save comes first
        deadline = time.monotonic() + grace_s
        print(f"staleflow: {why}; saving a checkpoint before stopping", file=sys.stderr, flush=True)
        try:
            try:  # the running step finishes; nothing new starts
                self.loop.run(
                    until=lambda: not self.view.training, timeout_s=grace_s, hold_training=True, dispatch=False
                )
            except LoopTimeout:
                print(
                    "staleflow: the training step did not finish in time; the last checkpoint stays the resume point",
                    file=sys.stderr,
                    flush=True,
                )
                return
            if self.save(export=False, timeout_s=max(1.0, deadline - time.monotonic()), durable=True, stopping=True):
                print(
                    f"staleflow: saved version {self.view.version}; resume with --resume {self.run_dir} "
                    f"(launch.sh restarts resume by themselves)",
                    file=sys.stderr,
                    flush=True,
                )
        except (RankDied, RuntimeError) as e:
            print(
                f"staleflow: no checkpoint on the way out ({e}); the last checkpoint stays the resume point",
                file=sys.stderr,
                flush=True,
            )

    # ---- the job -------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except RankDied as e:
            if e.rank is not None and self.ctl.roles.role(e.rank) == "rollout":
                self.ctl.left.add(e.rank)
                self.save_before_stop(str(e))
            raise
        except KeyboardInterrupt as e:
            self.save_before_stop(str(e) or "interrupted")
            raise
        finally:
            self.rewards.close()
            self.progress.close()
            self.writer.close()
            self.backend.close()

    def _run(self) -> None:
        loop, view = self.loop, self.view
        pull = view.version if view.version > 0 else None  # resumed: every instance loads the trainer's weights first
        if self.held_out is not None and view.version == 0:
            self.start_eval(0)
        while not view.done:
            loop.run(
                until=lambda: view.done or self.save_due or self.failure is not None,
                hold_training=lambda: self.save_due,  # a due checkpoint holds exactly this version
                stall_s=lambda: 3 * self.stall_limit_s,  # three times the hub's stuck-rank limit
                pull=pull,
            )
            pull = None
            if self.failure is not None:
                raise self.failure
            if self.save_due:
                self.save(export=False)
        if self.held_out is not None:
            self.final_eval()
        self.save(export=self.cfg.checkpoint.export_hf, final=True)
        self.progress.close()
        if self.cfg.log.plot:
            from staleflow.metrics.report import make_report

            make_report(self.run_dir)
        print(f"[controller] run folder: {self.run_dir}", flush=True)


def training_job(ctl, cfg) -> None:
    with ctl.beating():  # the build reads the tokenizer and the data and starts the reward pool: ranks wait
        job = TrainingJob(ctl, cfg)
    job.run()
