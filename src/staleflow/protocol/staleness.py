"""The staleness manager: per-trajectory bounded staleness via Reserve / Occupy / Consume.

Pure, single-threaded bookkeeping (no torch, no I/O) owned by the controller and driven by the
coordinator. Paper terms: V_traj = ``traj_version``, V_buf = buffer version, eta = staleness
bound. Every consumed group satisfies ``traj_version <= buffer_version <= traj_version + eta``
(docs/protocol.md has the argument).

Model. Versions are ints; training on buffer v produces model v+1; ``manager.version`` is the
next buffer to consume (= the newest model that can exist). The staleness buffers are a
``BufferBook`` (protocol/buffers.py: one per version, ``capacity`` entries (B' >= B), Ready once
``batch_size`` (B) entries are OCCUPIED); this file holds the rules over them: which buffer of a
group's window it reserves, occupies and is consumed from. An entry is one prompt GROUP (GRPO); its members are single trajectories. A group's
``traj_version`` is the min V_traj over its members. ``group_capacity`` (N') members may be in
flight; the group is complete when ``group_size`` (N) have finished, and the rest are aborted.
Ids are ints or strs; misuse raises ``ProtocolError`` naming the bad value and changes nothing.

Occupy exchange (PSRL ``StalenessInventory.clear_reserved_entries(move_across_buffer=True)``,
on by default, ``exchange=False`` is the ablation): before a finished group X leaves its
reservation in buffer b, the newest reservation Y in the earliest earlier buffer of X's window
whose own window also covers b (b - eta <= V_Y) moves into X's slot in b; X's greedy Occupy then
finds the slot Y freed. Early finishers fill early buffers, reservations drift to their worst
case, and both stay inside their windows (Y: b <= V_Y + eta; X: final buffer <= b).

Train order (``train_order="drawn"``, protocol/order.py): consume(v) first swaps v's groups with
earlier-started occupied groups of later buffers, each staying in its window; "completion" is the above.

Interrupt and migration change NOTHING here: V_traj is immutable and fixed at dispatch, so an
interrupted trajectory keeps its reservation; the router must only resume it on an instance
whose weight version is >= V_traj. Buffers never hold RESERVED entries once Ready: the
surplus (B' > B) is moved to the latest other buffer of its window with room, or closed.
"""

from __future__ import annotations

from staleflow.protocol.buffers import BufferBook
from staleflow.protocol.checkpoint import manager_from_state_dict, manager_state_dict, manager_stats, validate_manager
from staleflow.protocol.members import Members
from staleflow.protocol.order import reorder
from staleflow.protocol.types import _FAST_ID, BufferState, EntryState, ProtocolError, StalenessSpec, _check_id, _Group


class StalenessManager(Members):
    """Staleness buffers + group tracker (the StaleFlow protocol); see the module docstring.

    m = StalenessManager(StalenessSpec(eta=1, batch_size=2))
    m.reserve("t0", "g0", 0); m.complete("t0"); m.occupy("g0"); m.ready_version()
    """

    bounded = True
    """Every consumed group is within eta of its V_traj (the loop audits it as a hard invariant)."""

    def __init__(self, spec: StalenessSpec, exchange: bool = True, train_order: str = "completion"):
        if not isinstance(spec, StalenessSpec):
            raise ProtocolError(f"StalenessManager takes a StalenessSpec, got {type(spec).__name__}")
        super().__init__(spec.group_size)  # the member table (protocol/members.py): complete, abort
        self.spec = spec
        self.eta, self.batch_size, self.capacity = spec.eta, spec.batch_size, spec.capacity
        self.group_capacity = spec.group_capacity
        if not isinstance(exchange, bool):
            raise ProtocolError(f"StalenessManager exchange={exchange!r} is invalid: must be a bool")
        self.exchange = exchange
        self.exchanges = 0  # reservations moved by the occupy exchange (metrics)
        if train_order not in ("completion", "drawn"):
            raise ProtocolError(f"StalenessManager train_order={train_order!r} is invalid: 'completion' or 'drawn'")
        self.train_order = train_order  # "drawn": consume() first trains the earliest-started (protocol/order.py)
        self.order_swaps = 0  # occupied groups exchanged by the drawn order (metrics)
        self._seq: dict | None = {} if train_order == "drawn" else None  # group_id -> start number (drawn)
        self._next_seq = 0
        self.version = spec.version  # a fresh manager for a run resumed at model `version` has nothing older
        self.closed_version = spec.version - 1  # no V_traj <= this is admitted (its window is Ready/consumed)
        self.book = BufferBook(spec.batch_size, spec.capacity)
        self._groups: dict = {}  # in-flight or occupied (not yet consumed) groups
        self._closed: dict = {}  # group_id -> None: in flight but unplaceable
        self._finished: dict = {}  # group_id -> "consumed" | "aborted: <reason>"
        self._log: list[tuple] = []  # (group_id, traj_version, buffer_version)
        self._aborted: dict = {}  # group_id -> reason
        self._abort_counts: dict[str, int] = {}  # reason -> groups aborted
        self._member_abort_counts: dict[str, int] = {}  # reason -> members aborted

    # ---- queries -------------------------------------------------------------------------
    def _check_version(self, traj_version) -> int:
        if type(traj_version) is int and 0 <= traj_version <= self.version:
            return traj_version
        if not isinstance(traj_version, int) or isinstance(traj_version, bool) or traj_version < 0:
            raise ProtocolError(f"traj_version {traj_version!r} must be an int >= 0")
        if traj_version > self.version:
            raise ProtocolError(
                f"traj_version {traj_version} does not exist yet: the newest model is "
                f"{self.version} (buffer {self.version - 1} consumed last)"
            )
        return traj_version

    def _window_room(self, V: int) -> int | None:
        """Worst case: the latest buffer of V's window [max(V, version), V + eta] with room."""
        if V <= self.closed_version:
            return None
        full = self.book.full
        for u in range(V + self.eta, (V if V > self.version else self.version) - 1, -1):
            if u not in full:
                return u
        return None

    def can_admit(self, traj_version: int, group_id=None) -> bool:
        """True iff ``reserve(_, group_id, traj_version)`` would succeed: a new group at this
        V_traj (or a new member of in-flight ``group_id``) has a buffer in its window with room."""
        V = traj_version
        if type(V) is not int or not 0 <= V <= self.version:
            self._check_version(V)
        if group_id is not None:
            g = self._groups.get(group_id)
            if g is not None:
                return (
                    not g.occupied
                    and g.buffer is not None
                    and g.buffer <= V + self.eta
                    and len(g.done) < self.group_size
                    and len(g.live) + len(g.done) < self.group_capacity
                )
            if group_id in self._finished:
                return False
        return self._window_room(V) is not None

    def on_rollout_version(self, version: int) -> None:
        """Every instance now runs `version` (a global weight update finished). The per-trajectory
        protocol does not care which version the instances run; count-based peers do."""

    def ready_version(self) -> int | None:
        """``version`` when buffer ``version`` is Ready (the trainer may consume it), else None."""
        b = self.book.buffers.get(self.version)  # (inlined BufferBook.is_ready: the trainer asks every turn)
        return self.version if b is not None and len(b.occupied) >= self.batch_size else None

    def buffer_state(self, v: int) -> BufferState:
        if v < self.version:
            raise ProtocolError(f"buffer {v} was already consumed (next is {self.version})")
        return self.book.state(v)

    def buffer_entries(self, v: int) -> dict:
        self.buffer_state(v)
        return self.book.entries(v)

    def _group(self, group_id) -> _Group:
        g = self._groups.get(group_id)
        if g is None:
            if group_id in self._finished:
                raise ProtocolError(f"group {group_id!r} is already {self._finished[group_id]}")
            raise ProtocolError(f"unknown group id {group_id!r}: reserve one of its members first")
        return g

    def group_info(self, group_id) -> dict:
        g = self._group(group_id)
        return g.info("occupied" if g.occupied else ("closed" if g.buffer is None else "reserved"))

    def closed_windows(self) -> list:
        """In-flight groups that can no longer be placed (every buffer of their window became
        Ready); the runtime aborts them."""
        return list(self._closed)

    def stuck_stragglers(self, threshold: int) -> list:
        """If the next buffer is Stuck with <= threshold RESERVED entries, the groups holding them
        (the runtime aborts them, or truncates them: complete the members, then occupy)."""
        if not isinstance(threshold, int) or threshold < 1:
            raise ProtocolError(f"stuck_stragglers threshold {threshold!r} must be an int >= 1")
        if self.buffer_state(self.version) is not BufferState.STUCK:
            return []
        b = self.book.get(self.version)
        return list(b.reserved) if len(b.reserved) <= threshold else []

    def consumption_log(self) -> list[tuple]:
        return list(self._log)

    def aborted_groups(self) -> dict:
        return dict(self._aborted)

    # ---- operations ----------------------------------------------------------------------
    def reserve(self, traj_id, group_id, traj_version: int) -> int:
        """At dispatch: a new group takes the LATEST buffer in [V, V+eta] with an EMPTY entry
        (worst case); a member of an in-flight group joins its entry (needs buffer <= V+eta).
        Requires 0 <= traj_version <= version. Returns the reserved buffer version."""
        if type(traj_id) not in _FAST_ID:
            _check_id("traj_id", traj_id)
        if type(group_id) not in _FAST_ID:
            _check_id("group_id", group_id)
        V = traj_version
        if type(V) is not int or not 0 <= V <= self.version:
            self._check_version(V)
        if traj_id in self._trajs:
            raise ProtocolError(f"traj_id {traj_id!r} is already reserved (group {self._trajs[traj_id].group_id!r})")
        g = self._groups.get(group_id)
        if g is not None:  # a new member joins its group's entry
            if g.occupied or g.buffer is None or len(g.done) >= self.group_size:
                state = "occupied" if g.occupied else ("closed" if g.buffer is None else "complete")
                raise ProtocolError(f"group {group_id!r} is {state}: it takes no new member {traj_id!r}")
            if len(g.live) + len(g.done) >= self.group_capacity:
                raise ProtocolError(f"group {group_id!r} already has group_capacity={self.group_capacity} members")
            if g.buffer > V + self.eta:
                raise ProtocolError(
                    f"member {traj_id!r} at traj_version {V} cannot join group {group_id!r} "
                    f"reserved in buffer {g.buffer} > {V} + eta {self.eta}"
                )
            g.live[traj_id] = None
            if V < g.traj_version:
                g.traj_version = V
            self._trajs[traj_id] = g
            return g.buffer
        if group_id in self._finished:
            raise ProtocolError(f"group {group_id!r} is already {self._finished[group_id]}; use a new group id")
        v = None
        if V > self.closed_version:  # (inlined _window_room: the hot path of every dispatch)
            full = self.book.full
            for u in range(V + self.eta, (V if V > self.version else self.version) - 1, -1):
                if u not in full:
                    v = u
                    break
        if v is None:
            raise ProtocolError(
                f"traj_version {V} is not admissible: no buffer in [{V}, {V + self.eta}] has "
                f"an EMPTY entry (check can_admit first; the trajectory waits)"
            )
        self._groups[group_id] = self._trajs[traj_id] = _Group(group_id, V, v, traj_id)
        self.book.reserve(group_id, v)
        if self._seq is not None:
            self._seq[group_id] = self._next_seq
            self._next_seq += 1
        return v

    def occupy(self, group_id) -> int:
        """After generation AND reward of N members: release the reservation (after the occupy
        exchange) and take the EARLIEST buffer in [max(Vg, version), reserved] with a free
        required slot. Returns the buffer version."""
        g = self._groups.get(group_id) or self._group(group_id)  # the slow path raises
        if g.occupied:
            raise ProtocolError(f"group {group_id!r} already occupies buffer {g.buffer}")
        if g.buffer is None:
            raise ProtocolError(f"group {group_id!r} can no longer be placed (its window closed): abort it")
        if len(g.done) < self.group_size:
            raise ProtocolError(
                f"group {group_id!r} has {len(g.done)} of group_size={self.group_size} "
                f"members complete: occupy after generation and reward of the group"
            )
        v0 = g.buffer
        lo = g.traj_version if g.traj_version > self.version else self.version
        if self.exchange and lo < v0:
            self._exchange(lo, v0)
        v, full = v0, self.book.full
        for cand in range(lo, v0):  # greedy: the earliest buffer with a free required slot
            if cand not in full:
                v = cand
                break
        assert self.version <= v <= v0 <= g.traj_version + self.eta, (group_id, v, v0)
        self.book.release(group_id, v0)  # not Ready (no reservation survives in a Ready buffer)
        g.buffer, g.occupied = v, True
        if self.book.occupy(group_id, v):
            self._on_ready(v)
        return v

    def _exchange(self, lo: int, b: int) -> None:
        """PSRL's occupy exchange: move the newest reservation Y of the earliest buffer in
        [lo, b) that may legally live in b (b - eta <= V_Y) into b, freeing its slot."""
        need = b - self.eta
        for bid in range(lo, b):
            buf = self.book.get(bid)
            if buf is None or not buf.reserved:
                continue
            for yid in reversed(buf.reserved):  # PSRL fills reservations from the back: newest first
                y = self._groups[yid]
                if y.traj_version >= need:
                    self.book.move(yid, bid, b)
                    y.buffer = b
                    self.exchanges += 1
                    return

    def _on_ready(self, v: int) -> None:
        """Buffer v just became Ready: move its surplus reservations (B' > B) or close them."""
        for gid in self.book.take_reserved(v):
            g = self._groups[gid]
            dest = self.book.latest_room(max(g.traj_version, self.version), g.traj_version + self.eta, skip=v)
            if dest is None:
                g.buffer = None
                self._closed[gid] = None
            else:
                g.buffer = dest
                self.book.reserve(gid, dest)
        # closed_version: the largest V whose whole window [V, V+eta] (from version on) is Ready
        for V in range(v, max(v - self.eta, self.closed_version + 1) - 1, -1):
            if all(self.book.is_ready(u) for u in range(max(V, self.version), V + self.eta + 1)):
                self.closed_version = V
                break

    def consume(self, v: int) -> list:
        """Free buffer ``v`` (== version, Ready) and return its groups; version += 1."""
        if v != self.version:
            raise ProtocolError(f"consume({v!r}) out of order: the next buffer to consume is {self.version}")
        if self.ready_version() is None:
            raise ProtocolError(
                f"buffer {v} is not Ready ({self.buffer_state(v).value}, "
                f"{self.buffer_entries(v)[EntryState.OCCUPIED]}/{self.batch_size} occupied)"
            )
        if self._seq is not None:
            self.order_swaps += reorder(self, v)
        occupied = self.book.pop(v)
        for gid in occupied:
            g = self._groups.pop(gid)
            if self._seq is not None:
                del self._seq[gid]
            assert g.traj_version <= v <= g.traj_version + self.eta, (gid, g.traj_version, v)
            for t in g.done:
                del self._trajs[t]
            self._log.append((gid, g.traj_version, v))
            self._finished[gid] = "consumed"
        self.version += 1
        return occupied

    def _member_dropped(self, reason: str) -> None:
        self._member_abort_counts[reason] = self._member_abort_counts.get(reason, 0) + 1

    def abort_group(self, group_id, reason: str) -> list:
        """Drop an in-flight group (closed window, straggler, filter); returns members to stop."""
        if not isinstance(reason, str) or not reason:
            raise ProtocolError(f"abort_group reason {reason!r} must be a non-empty str")
        g = self._group(group_id)
        if g.occupied:
            raise ProtocolError(f"abort_group: group {group_id!r} already occupies buffer {g.buffer}")
        if g.buffer is None:
            del self._closed[group_id]
        else:
            self.book.release(group_id, g.buffer)
        live = list(g.live)
        for t in live + list(g.done):
            del self._trajs[t]
        del self._groups[group_id]
        if self._seq is not None:
            del self._seq[group_id]
        self._aborted[group_id] = reason
        self._finished[group_id] = f"aborted: {reason}"
        self._abort_counts[reason] = self._abort_counts.get(reason, 0) + 1
        return live

    # ---- metrics, checkpoint, self-check (protocol/checkpoint.py) -------------------------------
    def stats(self) -> dict:
        """JSON-able metrics (per-buffer counts, in flight, aborts, occupy exchanges)."""
        return manager_stats(self)

    def state_dict(self) -> dict:
        """JSON-able checkpoint; ``from_state_dict`` rebuilds an identical manager."""
        return manager_state_dict(self)

    @classmethod
    def from_state_dict(cls, d: dict):
        return manager_from_state_dict(cls, d)

    def validate(self) -> None:
        """Recompute every derived structure from the group table; raise on any mismatch (tests)."""
        validate_manager(self)
