"""Property test: random interleavings of the whole trajectory lifecycle against the manager.

A hypothesis RuleBasedStateMachine plays the runtime: admit / reserve (new groups and extra
members) / interrupt + migrate (no manager call: V_traj is immutable) / complete / occupy
(after reward) / consume / member crash / group abort / closed-window aborts / straggler abort
or truncate / crash-and-restore through a JSON state dict, with random eta, B, B', N, N'.
Each step checks reserve/occupy against an independent oracle computed from the buffer counts;
the invariants (bound, no double consumption, accounting, version order, internal consistency)
are checked after every step, and a liveness rule drives everything to completion and demands
that the trainer gets its next buffer.
"""

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from staleflow.protocol import EntryState, ProtocolError, StalenessManager, StalenessSpec

REASONS = ("crash", "redundancy", "filter")


class ProtocolMachine(RuleBasedStateMachine):
    @initialize(
        eta=st.integers(0, 3),
        B=st.integers(1, 4),
        extra_b=st.integers(0, 2),
        N=st.integers(1, 3),
        extra_n=st.integers(0, 2),
        exchange=st.booleans(),
        order=st.sampled_from(["completion", "drawn"]),
    )
    def setup(self, eta, B, extra_b, N, extra_n, exchange, order):
        self.eta, self.B, self.N, self.exchange, self.order = eta, B, N, exchange, order
        spec = StalenessSpec(eta, B, B + extra_b, N, N + extra_n)
        self.m = StalenessManager(spec, exchange=exchange, train_order=order)
        self.next_id = 0
        self.versions: dict = {}  # gid -> {traj_id: V_traj} of every member ever reserved
        self.live: dict = {}  # traj_id -> gid, members still generating (runtime view)
        self.done: dict = {}  # gid -> set of finished members
        self.instance_of: dict = {}  # traj_id -> weight version of the instance running it
        self.consumed_buffers: list = []

    # ---- helpers ---------------------------------------------------------------------------
    def new_id(self, kind):
        self.next_id += 1
        return f"{kind}{self.next_id}"

    def has_room(self, v):
        e = self.m.buffer_entries(v)
        return e[EntryState.OCCUPIED] < self.B and e[EntryState.EMPTY] > 0

    def oracle_reserve(self, V):
        """Latest buffer in [V, V+eta] (not consumed) with a free entry, else None."""
        for v in range(V + self.eta, max(V, self.m.version) - 1, -1):
            if self.has_room(v):
                return v
        return None

    def in_flight(self):
        return sorted(g for g in self.versions if self.state(g) in ("reserved", "closed"))

    def state(self, gid):
        try:
            return self.m.group_info(gid)["state"]
        except ProtocolError as e:
            return "aborted" if "aborted" in str(e) else "consumed"

    def forget_members(self, trajs):
        for t in trajs:
            self.live.pop(t, None)
            self.instance_of.pop(t, None)

    def forget_group(self, gid):
        self.forget_members([t for t, g in self.live.items() if g == gid])

    def reserve(self, gid, V):
        t = self.new_id("t")
        v = self.m.reserve(t, gid, V)
        self.versions.setdefault(gid, {})[t] = V
        self.live[t] = gid
        self.instance_of[t] = V
        return v

    # ---- runtime actions -------------------------------------------------------------------
    @rule(age=st.integers(0, 4))
    def admit(self, age):
        V = max(0, self.m.version - age)
        gid = self.new_id("g")
        expected = self.oracle_reserve(V)
        assert self.m.can_admit(V) == (expected is not None)
        if expected is None:
            try:
                self.m.reserve(self.new_id("t"), gid, V)
            except ProtocolError:
                return
            raise AssertionError("reserve accepted an inadmissible trajectory")
        assert self.reserve(gid, V) == expected  # worst case: the latest feasible buffer
        self.done[gid] = set()

    @rule(n=st.integers(1, 8), age=st.integers(0, 2))
    def burst(self, n, age):
        """Dispatch n whole groups (N' members each) at once: saturates windows, as routing does."""
        V = max(0, self.m.version - age)
        for _ in range(n):
            if not self.m.can_admit(V):
                break
            gid = self.new_id("g")
            self.done[gid] = set()
            for _ in range(self.m.group_capacity):
                self.reserve(gid, V)

    @precondition(lambda self: self.in_flight())
    @rule(data=st.data(), age=st.integers(0, 3))
    def add_member(self, data, age):
        gid = data.draw(st.sampled_from(self.in_flight()))
        V = max(0, self.m.version - age)
        info = self.m.group_info(gid)
        ok = (
            info["state"] == "reserved"
            and info["buffer_version"] <= V + self.eta
            and len(info["done"]) < self.N
            and len(info["live"]) + len(info["done"]) < self.m.group_capacity
        )
        assert self.m.can_admit(V, group_id=gid) == ok
        if ok:
            assert self.reserve(gid, V) == info["buffer_version"]
        else:
            before = self.m.state_dict()
            try:
                self.m.reserve(self.new_id("t"), gid, V)
            except ProtocolError:
                assert self.m.state_dict() == before
                return
            raise AssertionError("a member joined a group it may not join")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def interrupt_and_migrate(self, data):
        # Interrupt keeps the partial trajectory; it resumes on any instance whose weight
        # version is >= V_traj. The manager is not told: V_traj and the reservation stay.
        t = data.draw(st.sampled_from(sorted(self.live)))
        V = self.versions[self.live[t]][t]
        before = self.m.state_dict()
        self.instance_of[t] = data.draw(st.integers(V, self.m.version))
        assert self.m.state_dict() == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def complete(self, data):
        t = data.draw(st.sampled_from(sorted(self.live)))
        gid = self.live.pop(t)
        assert self.instance_of.pop(t) >= self.versions[gid][t]
        self.done[gid].add(t)
        surplus = self.m.complete(t)
        still = sorted(u for u, g in self.live.items() if g == gid)
        if len(self.done[gid]) == self.N:
            assert sorted(surplus) == still  # group reached N: every other member is aborted
            self.forget_members(surplus)
        else:
            assert surplus == []

    def reservations(self):
        """{gid: (buffer, group V_traj)} of every in-flight group holding a reservation."""
        out = {}
        for g in self.in_flight():
            info = self.m.group_info(g)
            if info["state"] == "reserved":
                out[g] = (info["buffer_version"], info["traj_version"])
        return out

    def occupy_group(self, gid):
        info = self.m.group_info(gid)
        lo, v0 = max(info["traj_version"], self.m.version), info["buffer_version"]
        before = self.reservations()
        # occupy exchange oracle: the earliest buffer in [lo, v0) holding a reservation that may live in v0
        swap = None
        if self.exchange:
            swap = min(
                (b for g, (b, V) in before.items() if g != gid and lo <= b < v0 and V >= v0 - self.eta), default=None
            )
        expected = next((v for v in range(lo, v0) if v == swap or self.has_room(v)), v0)  # earliest free
        v = self.m.occupy(gid)
        assert v == expected and lo <= v <= v0 <= info["traj_version"] + self.eta
        after = self.reservations()
        moved = {g: (before[g][0], after[g][0]) for g in after if after[g][0] != before[g][0]}
        for g, (_, dst) in moved.items():
            assert after[g][1] <= dst <= after[g][1] + self.eta  # every move stays inside its window
        # a buffer that just became Ready moves its surplus reservations (B' > B); the rest is the exchange
        ready = self.m.buffer_state(v).value == "ready"
        exchanged = [m for g, m in moved.items() if not (ready and m[0] == v)]
        if swap is None:
            assert exchanged == []
        elif ready and swap == v:
            assert (swap, v0) in moved.values()
        else:  # exactly one reservation moved, from the swap buffer into the vacated one
            assert exchanged == [(swap, v0)]

    def completed_groups(self):
        return sorted(
            g for g in self.in_flight() if self.state(g) == "reserved" and len(self.m.group_info(g)["done"]) >= self.N
        )

    @precondition(lambda self: self.completed_groups())
    @rule(data=st.data())
    def reward_and_occupy(self, data):
        self.occupy_group(data.draw(st.sampled_from(self.completed_groups())))

    def occupied(self):
        """{gid: (buffer, group V_traj)} of every occupied (not yet consumed) group."""
        infos = (self.m.group_info(g) for g in self.versions if self.state(g) == "occupied")
        return {i["group_id"]: (i["buffer_version"], i["traj_version"]) for i in infos}

    @precondition(lambda self: self.m.ready_version() is not None)
    @rule()
    def consume(self):
        v = self.m.version
        before, swaps = self.occupied(), self.m.order_swaps
        later = range(v + 1, v + self.eta + 2)
        counts = {w: (self.m.buffer_entries(w), self.m.buffer_state(w)) for w in later}
        groups = self.m.consume(v)
        assert len(groups) == self.B
        self.consumed_buffers.append(v)
        # the drawn order only swaps occupied groups: no buffer's counts or state change, reservations stay
        assert {w: (self.m.buffer_entries(w), self.m.buffer_state(w)) for w in later} == counts
        after = self.occupied()
        assert set(groups) | set(after) == set(before) and not set(groups) & set(after)
        if self.order == "completion":
            assert sorted(groups) == sorted(g for g, (b, _) in before.items() if b == v)
            assert self.m.order_swaps == 0 and after == {g: p for g, p in before.items() if g not in groups}
            return
        moved = sum(1 for g in groups if before[g][0] != v)
        assert self.m.order_swaps - swaps >= moved
        start = {g: int(g[1:]) for g in before}  # ids are numbered in reserve order: the start order
        for y, (w, vy) in after.items():  # no legal swap would bring an earlier-started group into v
            if vy <= v:
                for x in groups:
                    assert not (start[y] < start[x] and w <= before[x][1] + self.eta), (y, w, x)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), reason=st.sampled_from(REASONS))
    def abort_member(self, data, reason):
        t = data.draw(st.sampled_from(sorted(self.live)))
        gid = self.live[t]
        remaining = len(self.m.group_info(gid)["live"]) + len(self.m.group_info(gid)["done"]) - 1
        dropped = self.m.abort(t, reason)
        self.forget_members([t])
        assert dropped == ([gid] if remaining < self.N else [])
        if dropped:
            self.forget_group(gid)
            assert self.m.aborted_groups()[gid] == reason

    @precondition(lambda self: self.in_flight())
    @rule(data=st.data(), reason=st.sampled_from(REASONS))
    def abort_group(self, data, reason):
        gid = data.draw(st.sampled_from(self.in_flight()))
        expected = sorted(u for u, g in self.live.items() if g == gid)
        assert sorted(self.m.abort_group(gid, reason)) == expected
        self.forget_group(gid)

    @rule()
    def abort_closed_windows(self):
        for gid in self.m.closed_windows():
            self.m.abort_group(gid, "closed_window")
            self.forget_group(gid)

    @rule(threshold=st.integers(1, 3), truncate=st.booleans())
    def handle_stragglers(self, threshold, truncate):
        for gid in self.m.stuck_stragglers(threshold):
            info = self.m.group_info(gid)
            if info["state"] == "closed":  # truncating an earlier straggler made the buffer Ready
                assert gid in self.m.closed_windows()
                self.m.abort_group(gid, "closed_window")
                self.forget_group(gid)
                continue
            if not truncate or len(info["live"]) + len(info["done"]) < self.N:
                self.m.abort_group(gid, "straggler")
                self.forget_group(gid)
                continue
            # truncate: the partial outputs count as finished responses
            for t in sorted(u for u, g in self.live.items() if g == gid):
                if t in self.live:
                    self.live.pop(t)
                    self.instance_of.pop(t)
                    self.done[gid].add(t)
                    self.forget_members(self.m.complete(t))
            self.occupy_group(gid)

    @rule()
    def crash_and_restore(self):
        sd = self.m.state_dict()
        self.m = StalenessManager.from_state_dict(json.loads(json.dumps(sd)))
        assert self.m.state_dict() == sd

    @rule()
    def liveness(self):
        """Keep generations finishing (and keep admitting): the trainer gets its next buffer."""
        target = self.m.version
        for _ in range(6):
            self.abort_closed_windows()
            for gid in self.in_flight():  # top up groups dispatched with fewer than N members
                info = self.m.group_info(gid)
                for _ in range(self.N - len(info["live"]) - len(info["done"])):
                    assert self.m.can_admit(self.m.version, group_id=gid)
                    self.reserve(gid, self.m.version)
            for t in sorted(self.live):
                if t in self.live:
                    gid = self.live.pop(t)
                    self.instance_of.pop(t)
                    self.done[gid].add(t)
                    self.forget_members(self.m.complete(t))
            for gid in self.completed_groups():
                if self.state(gid) == "reserved":  # an earlier occupy may have closed it
                    self.occupy_group(gid)
            if self.m.ready_version() is not None:
                self.consume()
                return
            assert not self.m.stuck_stragglers(self.m.capacity), "stuck with nothing in flight"
            for _ in range(self.B):  # admit one batch worth, not the whole window
                if not self.m.can_admit(self.m.version):
                    break
                gid = self.new_id("g")
                self.done[gid] = set()
                for _ in range(self.N):
                    self.reserve(gid, self.m.version)
        raise AssertionError(f"trainer blocked: buffer {target} never became Ready")

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.m.validate()

    @invariant()
    def bounded_and_accounted(self):
        log = self.m.consumption_log()
        gids = [g for g, _, _ in log]
        assert len(gids) == len(set(gids)), "a group was consumed twice"
        assert [bv for _, _, bv in log] == sorted(bv for _, _, bv in log)
        assert sorted(set(bv for _, _, bv in log)) == self.consumed_buffers == list(range(self.m.version))
        for gid, tv, bv in log:
            members = self.versions[gid]
            assert tv == min(members.values())
            assert all(V <= bv <= V + self.eta for V in members.values()), (gid, members, bv)
        aborted = self.m.aborted_groups()
        assert all(isinstance(r, str) and r for r in aborted.values())
        assert not set(aborted) & set(gids)
        for gid in self.versions:
            assert (gid in aborted) + (gid in set(gids)) + (self.state(gid) in ("reserved", "closed", "occupied")) == 1


TestProtocolMachine = ProtocolMachine.TestCase
TestProtocolMachine.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
