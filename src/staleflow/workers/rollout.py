"""The rollout-rank loop: one rollout instance executing the coordinator's commands.

    Route        add to the engine (a resumed partial trajectory brings its tokens from a ring)
    Interrupt    abort in the engine; write the partial record and report it (Finished, partial)
    Abort        abort in the engine and forget the output
    Pull         load the newest version from the PS. With --coordinator.interrupt-on-pull (the
                 default, partial rollout) everything still running or queued in the engine is
                 interrupted first (the coordinator's Interrupt named them, save any that left a tool
                 call since its last snapshot), while a multi-turn trajectory parked on a tool call
                 stays: the load frees its held KV and its next turn re-prefills under the new
                 weights (workers/turns.py, "pull"). With --coordinator.keep-kv-on-pull nothing
                 is interrupted: as in drain mode (interrupt-on-pull false, where the instance is
                 empty by then), the engine keeps its sequences across the load: their KV cache,
                 computed with the old weights, is kept and their next tokens come from the new
                 weights. Each token keeps the behaviour log-prob and the
                 version of the weights that sampled it (the trainer's off-policy correction)
    FreeRecords  release ring space the controller no longer needs
Between commands the engine steps; finished trajectories are written to this rank's ring and
announced with Finished; an InstanceSnapshot goes out every --rollout.stats-interval-ms.

With --env.name (multi-turn, tool-using trajectories) a TurnDriver (workers/turns.py) holds each
trajectory's environment and turns: routes, the engine's turn outputs, interrupts and held-out
prompts go through it, and its Finished carries turns, tool calls and tool seconds.

In a multi-node run (ctx.net, cluster/netplane.py) a rank on a node without trainer ranks also
ships each finished record to the trainer nodes before its Finished; a partial record produced on
another node is fetched from its producer before the trajectory resumes (consecutive Routes
are fetched together); a rank off the Parameter Server's node pulls weights over the network.
"""

from __future__ import annotations

import time

import msgspec
import torch

from staleflow.cluster.placement import reader_index
from staleflow.control.messages import (
    Evaluate,
    Evaluated,
    FreeRecords,
    Pulled,
    Shutdown,
    eval_request_id,
    is_eval,
    split_eval_id,
)
from staleflow.coordinator.types import Abort, InstanceSnapshot, Interrupt, Pull
from staleflow.engines import engine_backend
from staleflow.rollout.engine import Request, SamplingParams
from staleflow.servers import RingFull, StaleHandle, TrajectoryRing
from staleflow.servers.trajectory import DEFAULT_RING_BYTES
from staleflow.servers.weights import open_weight_source
from staleflow.trajectory import Finished, Route, TrajectoryTokens, TurnStats
from staleflow.workers.turns import TemplateCodec, TurnDriver, prompt_row

RING_BYTES = DEFAULT_RING_BYTES


def build_engine(ctx, model, backend=None):
    """The rank's engine, built by the backend --rollout.engine names (staleflow.engines)."""
    backend = backend or engine_backend(ctx.cfg)
    share = planned_gpu_share(ctx) if backend.takes_gpu_share and str(ctx.device).startswith("cuda") else None
    return backend.build(ctx, model, share)


def planned_gpu_share(ctx) -> float:
    """The share of its GPU the memory plan gives this rank's engine (a backend that takes_gpu_share)."""
    from staleflow.plan import build_plan

    plan = build_plan(
        ctx.cfg,
        ctx.roles.world_size,
        torch.cuda.get_device_properties(ctx.device).total_memory,
        num_gpus=torch.cuda.device_count(),
    )
    return plan.gpu_share[ctx.rank]


def keeps_kv_on_pull(coordinator_cfg) -> bool:
    """Whether a Pull keeps the engine's sequences and their KV: the coordinator interrupts nothing
    before it (--coordinator.keep-kv-on-pull), or drains the instance first (interrupt-on-pull false)."""
    return coordinator_cfg.keep_kv_on_pull or not coordinator_cfg.interrupt_on_pull


class RolloutWorker:
    turns: TurnDriver | None = None
    """The turn driver of a multi-turn run (--env.name); None: single-turn trajectories."""

    def __init__(self, ctx, model):
        self.ctx = ctx
        self.instance = ctx.roles.instance_id(ctx.rank)
        backend = engine_backend(ctx.cfg)
        self.engine = build_engine(ctx, model, backend)
        self.ring = TrajectoryRing.create(ctx.run_id, ctx.rank, RING_BYTES)
        self.readers: dict[int, TrajectoryRing] = {ctx.rank: self.ring}
        rc = ctx.cfg.rollout
        self.params = dict(temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k, max_new_tokens=rc.max_new_tokens)
        self.keep_on_pull = keeps_kv_on_pull(ctx.cfg.coordinator)
        self.unsent: list[tuple] = []  # records waiting for ring space (back-pressure)
        self.stats_every = rc.stats_interval_ms / 1000.0
        self._last_stats = 0.0
        self._last_tokens, self._last_t = 0, time.monotonic()
        self.net = ctx.net
        world = ctx.roles.world_size
        self.weights = open_weight_source(
            ctx.run_id,
            backend,
            reader=reader_index(ctx.rank, world),
            worker_reader=reader_index(ctx.rank, world, engine_worker=True),
            remote=self.net.remote_weights() if self.net is not None else None,
            node=self.net.node if self.net is not None else 0,
            home=self.net.topo.home if self.net is not None else 0,
        )
        self.waiting_fetch: list[Route] = []  # routes whose partial record is on another node
        self.crossed: dict[int, tuple[int, int]] = {}  # traj_id -> (copies, bytes) fetched to resume it
        self.turns = build_turn_driver(ctx.cfg, self.engine, self._emit_turns) if ctx.cfg.env.name else None

    # ---- commands ------------------------------------------------------------------------
    def _reader(self, rank: int) -> TrajectoryRing:
        if rank not in self.readers:
            self.readers[rank] = TrajectoryRing.attach(self.ctx.run_id, rank, timeout=30)
        return self.readers[rank]

    def route(self, msg: Route, rec: TrajectoryTokens | None = None) -> None:
        if msg.partial is not None and rec is None:
            if self.net is not None and self.net.fetches_from(msg.partial.rank):
                self.waiting_fetch.append(msg)  # fetched with its neighbours before anything else runs
                return
            try:
                rec = self._reader(msg.partial.rank).read(msg.partial)
            except StaleHandle:
                # The controller only frees a partial record that is being resumed when it has
                # dropped the trajectory (an Abort that crossed this Route): nothing to resume.
                return
        # A resumed trajectory continues from its partial payload (read from the ring), a new one from the prompt.
        tokens = rec.copy() if rec is not None else TrajectoryTokens(list(msg.prompt_ids))
        if self.turns is not None:
            row = prompt_row(msg.traj_id, msg.prompt_ids, self.turns.decode(list(msg.prompt_ids)), msg.answer, msg.meta)
            self.turns.start(msg.traj_id, row, tokens, SamplingParams(seed=msg.seed, **self.params))
            return
        params = dict(self.params)
        if msg.max_new_tokens:
            params.update(max_new_tokens=msg.max_new_tokens, ignore_eos=True)
        self.engine.add(Request(msg.traj_id, tokens, SamplingParams(seed=msg.seed, **params)))

    def fetch_waiting(self) -> None:
        """Fetch the partial records of the routes waiting for them (one round trip for all of them,
        serving this rank's own records meanwhile), then route them in their order."""
        if not self.waiting_fetch:
            return
        routes, self.waiting_fetch = self.waiting_fetch, []
        got = self.net.fetcher.fetch([m.partial for m in routes], serve=self.serve_records)
        for m in routes:
            rec = got.get(m.partial)
            if rec is None:  # freed by the controller meanwhile (the trajectory was dropped)
                continue
            self.crossed[m.traj_id] = (1, m.partial.length)
            self.route(m, rec)

    def serve_records(self) -> None:
        if self.net is not None and self.net.record_server is not None:
            self.net.record_server.serve(self.ring)

    def interrupt(self, ids, drop: bool) -> None:
        st = self.engine.stats()
        held = set(st.running_ids) | set(st.waiting_ids) | set(getattr(st, "parked_ids", ()))  # engines without turns
        live = [t for t in ids if t in held]  # the others finished meanwhile: their Finished is on its way
        for out in self.engine.abort(live):
            ep = self.turns.forget(out.request_id) if self.turns is not None else None
            if not drop:
                self.emit(out, partial=True, stats=ep.stats if ep is not None else None)
        for t in ids:  # multi-turn ones outside the engine (a resumed one's replay or re-run tool call)
            ep = self.turns.forget(t) if self.turns is not None and t not in held else None
            if ep is not None and not drop:
                self._emit_turns(t, ep.tokens, "abort", True, ep.stats)

    def pull(self, msg: Pull) -> None:
        t0 = time.monotonic()
        if not self.keep_on_pull:  # partial rollout: nothing runs across a weight load
            st = self.engine.stats()
            self.interrupt([t for t in list(st.running_ids) + list(st.waiting_ids) if not is_eval(t)], drop=False)
        version, nbytes, by_node = self.weights.load(self.engine, keep_kv=self.keep_on_pull)
        self._pulled(msg, version, t0, nbytes, by_node)

    def _pulled(self, msg: Pull, version: int, t0: float, nbytes: int, by_node: dict[int, int] | None = None) -> None:
        if version < msg.version:
            raise RuntimeError(f"Pull({msg.version}): the parameter server only has version {version}")
        node = self.net.node if self.net is not None else 0
        crossed = sum(b for n, b in (by_node or {}).items() if n != node)
        self.ctx.client.send(
            Pulled(
                instance=self.instance,
                version=version,
                seconds=time.monotonic() - t0,
                nbytes=nbytes,
                cross_node=crossed > 0,
                by_node=dict(by_node or {}),
                cross_node_bytes=crossed,
            )
        )

    # ---- outputs -------------------------------------------------------------------------
    def emit(self, out, partial: bool, stats: TurnStats | None = None) -> None:
        """Write a finished or interrupted trajectory (or a held-out answer: negative id) to the ring
        and announce it: the engine's payload, the same path for training and evaluation."""
        self._emit_turns(out.request_id, out.tokens, out.finish_reason, partial, stats)

    def _emit_turns(self, request_id, tokens, reason: str, partial: bool, stats: TurnStats | None) -> None:
        """Queue a record for the ring (the turn driver's ended trajectories come here too)."""
        self.unsent.append((request_id, tokens, reason, partial, stats))
        self.flush()

    def on_output(self, out) -> None:
        """An engine output: a multi-turn trajectory's turn goes to the turn driver."""
        if self.turns is not None and self.turns.owns(out.request_id):
            self.turns.on_turn(out)
        else:
            self.emit(out, partial=False)

    def flush(self) -> None:
        while self.unsent:
            traj_id, rec, reason, partial, stats = self.unsent[0]
            try:
                h = self.ring.write(rec)
            except RingFull:
                return  # back-pressure: retry after the controller frees records
            self.unsent.pop(0)
            if is_eval(traj_id):
                self._answered(traj_id, rec, h)
                continue
            fetched, nbytes = self.crossed.pop(traj_id, (0, 0))
            copies = fetched
            if not partial and self.net is not None and self.net.shipper is not None:
                shipped = self.net.shipper.ship(self.ring, h)  # before Finished: the bytes lead the news
                copies, nbytes = copies + shipped[0], nbytes + shipped[1]
            self.ctx.client.send(
                Finished(
                    traj_id,
                    self.instance,
                    h,
                    len(rec.response_ids),
                    partial,
                    reason,
                    cross_node_copies=copies,
                    cross_node_bytes=nbytes,
                    fetched=fetched,
                    stats=None
                    if stats is None
                    else msgspec.structs.replace(stats),  # (a copy: the episode's counts on)
                )
            )

    def send_stats(self, now: float) -> None:
        st = self.engine.stats()
        dt = max(now - self._last_t, 1e-6)
        rate = (st.tokens_generated - self._last_tokens) / dt
        self._last_tokens, self._last_t = st.tokens_generated, now
        running = [t for t in st.running_ids if not is_eval(t)]  # held-out answers are not the coordinator's
        waiting = [t for t in st.waiting_ids if not is_eval(t)]
        between = [t for t in self.turns.waiting_ids if not is_eval(t)] if self.turns is not None else []
        tool = set(st.parked_ids) | set(self.turns.tool_waiting_ids if self.turns is not None else ())
        parked = tuple(t for t in tuple(running) + tuple(waiting) + tuple(between) if t in tool)
        self.ctx.client.send_stats(
            InstanceSnapshot(
                instance=self.instance,
                version=st.version,
                running=len(running),
                waiting=len(waiting),
                kv_tokens=st.kv_tokens,
                kv_capacity=st.kv_capacity,
                tokens_per_s=rate,
                syncing=False,
                time=now,
                traj_ids=tuple(running) + tuple(waiting) + tuple(between),
                tokens_generated=st.tokens_generated,
                parked_ids=parked,
            )
        )
        self._last_stats = now

    def progress(self) -> tuple[int, bool]:
        """(engine steps so far, whether the engine has work): read by the rank's pulse thread."""
        return self.engine.steps, self.engine.has_unfinished()

    # ---- loop ----------------------------------------------------------------------------
    def evaluate(self, msg: Evaluate) -> None:
        """Held-out prompts, answered greedily in the same engine as the rollout (negative ids)."""
        max_new = msg.max_new_tokens or self.params["max_new_tokens"]
        for k, (index, prompt) in enumerate(zip(msg.indices, msg.prompts)):
            if self.turns is not None:  # held-out prompts talk to the environment too, reset from their rows
                rid, ids = eval_request_id(msg.eval_id, index), list(prompt)
                params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
                answer, meta = (msg.answers[k], msg.metas[k]) if msg.metas else ("", {})
                row = prompt_row(rid, ids, self.turns.decode(ids), answer, meta)
                self.turns.start(rid, row, TrajectoryTokens(ids), params)
                continue
            self.engine.add(
                Request(
                    eval_request_id(msg.eval_id, index),
                    list(prompt),
                    SamplingParams(temperature=0.0, max_new_tokens=max_new),
                )
            )

    def _answered(self, request_id: int, tokens: TrajectoryTokens, h) -> None:
        """A held-out answer is in the ring: announce its record (the controller reads, scores, frees it)."""
        if self.net is not None and self.net.shipper is not None:
            self.net.shipper.ship(self.ring, h)  # to the controller's node, before the news
        eval_id, index = split_eval_id(request_id)
        versions = [v for v in tokens.versions if v >= 0] or [self.engine.stats().version]
        self.ctx.client.send(
            Evaluated(eval_id=eval_id, index=index, handle=h, min_version=min(versions), max_version=max(versions))
        )

    def free(self, handles) -> None:
        """Release ring records (exactly once, on the controller's word): after any zero-copy send of
        their bytes has left the ring, and the mirrors of other nodes are told."""
        for h in handles:
            if self.net is not None:
                self.net.sends.wait(h)
            self.ring.free(h)
        if self.net is not None and self.net.shipper is not None:
            self.net.shipper.freed(handles)
        self.flush()

    def handle(self, msg) -> bool:
        """Execute one command; False on Shutdown."""
        if not isinstance(msg, Route):
            self.fetch_waiting()  # a command after a route acts on the trajectory as routed
        if isinstance(msg, Evaluate):
            self.evaluate(msg)
        elif isinstance(msg, Route):
            self.route(msg)
        elif isinstance(msg, Interrupt):
            self.interrupt(msg.traj_ids, drop=False)
        elif isinstance(msg, Abort):
            self.interrupt(msg.traj_ids, drop=True)
        elif isinstance(msg, Pull):
            self.pull(msg)
        elif isinstance(msg, FreeRecords):
            self.free(msg.handles)
        elif isinstance(msg, Shutdown):
            return False
        return True

    def run(self) -> None:
        while True:
            tools = self.turns is not None and self.turns.busy  # env steps running: poll them often, without spinning
            msg = self.ctx.recv(0.0 if self.engine.has_unfinished() else 0.001 if tools else 0.005)
            while msg is not None:
                if not self.handle(msg):
                    return
                msg = self.ctx.recv(0.0)
            self.fetch_waiting()
            self.serve_records()
            now = time.monotonic()
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    self.on_output(out)
            if self.turns is not None:
                self.turns.poll()
            if now - self._last_stats >= self.stats_every:
                self.send_stats(now)

    def close(self) -> None:
        if self.turns is not None:
            self.turns.close()
        self.engine.close()  # an engine with processes of its own stops them
        for r in self.readers.values():
            if r is not self.ring:
                r.close()
        if self.net is not None:
            self.net.sends.wait_all()  # zero-copy sends read the ring until they are out
        self.ring.close()
        self.ring.unlink()
        self.weights.close()


def build_turn_driver(cfg, engine, emit) -> TurnDriver:
    """The turn driver of --env.name, with the model's tokenizer (turn texts, observation tokens)."""
    from staleflow.model import load_tokenizer, resolve_model_path

    codec = TemplateCodec(load_tokenizer(resolve_model_path(cfg.model.path)), cfg.env.tool_format)
    rc = cfg.rollout
    return TurnDriver(engine, cfg.env, codec, rc.max_new_tokens, rc.max_model_len, emit)
