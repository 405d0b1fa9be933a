"""The staleness manager's checkpoint format, metrics and self-check (pure Python, JSON-able dicts).

``StalenessManager.state_dict()`` / ``from_state_dict(d)``, ``stats()`` and ``validate()`` call these.
The dict survives ``json.dumps``/``json.loads`` unchanged (ids are ints or strs; tuples become
lists). ``validate_manager`` recomputes every derived structure from the group table and raises
ProtocolError on any inconsistency.
"""

from __future__ import annotations

from staleflow.protocol.types import ProtocolError, StalenessSpec, _Group

FORMAT = "staleflow.staleness/2"  # /2: members are ids only (each member's own V_traj is the ledger's)
_PARAMS = ("eta", "batch_size", "capacity", "group_size", "group_capacity")


def manager_state_dict(m) -> dict:
    return {
        "format": FORMAT,
        **{k: getattr(m, k) for k in _PARAMS},
        "exchange": m.exchange,
        "version": m.version,
        "closed_version": m.closed_version,
        "buffers": m.book.state_list(),
        "groups": [
            {
                "group_id": g.group_id,
                "traj_version": g.traj_version,
                "buffer": g.buffer,
                "occupied": g.occupied,
                "live": list(g.live),
                "done": list(g.done),
            }
            for g in m._groups.values()
        ],
        "closed": list(m._closed),
        "aborted": [[gid, reason] for gid, reason in m._aborted.items()],
        "consumed": [list(rec) for rec in m._log],
        "trajs_aborted_by_reason": dict(m._member_abort_counts),
        "occupy_exchanges": m.exchanges,
        "train_order": m.train_order,
        "order_swaps": m.order_swaps,
        **({} if m._seq is None else {"started": [[gid, n] for gid, n in m._seq.items()], "next_start": m._next_seq}),
    }


def manager_stats(m) -> dict:
    """JSON-able metrics: per-buffer entry counts and state, groups by state, aborts by reason."""
    buffers = {}
    for v in sorted(m.book.buffers):
        buffers[str(v)] = {"state": m.buffer_state(v).value, **{k.value: n for k, n in m.buffer_entries(v).items()}}
    in_flight = sum(1 for g in m._groups.values() if not g.occupied)
    return {
        "version": m.version,
        "closed_version": m.closed_version,
        "buffers": buffers,
        "groups_in_flight": in_flight,
        "groups_closed": len(m._closed),
        "groups_occupied": len(m._groups) - in_flight,
        "trajs_live": sum(len(g.live) for g in m._groups.values()),
        "groups_consumed": len(m._log),
        "occupy_exchanges": m.exchanges,
        "order_swaps": m.order_swaps,
        "groups_aborted_by_reason": dict(m._abort_counts),
        "trajs_aborted_by_reason": dict(m._member_abort_counts),
    }


def manager_from_state_dict(cls, d: dict):
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ProtocolError(f"not a staleness-manager state dict (format {got!r}, expected {FORMAT!r})")
    try:
        m = _rebuild(cls, d)
        validate_manager(m)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ProtocolError):
            raise
        raise ProtocolError(
            f"malformed staleness-manager state dict ({type(e).__name__}: {e}); pass the dict returned by state_dict()"
        ) from None
    return m


def _rebuild(cls, d: dict):
    spec = StalenessSpec(**{k: d[k] for k in _PARAMS}, version=d["version"])
    # a checkpoint from before the train order (no "train_order") trained in completion order
    m = cls(spec, exchange=d["exchange"], train_order=d.get("train_order", "completion"))
    m.closed_version = d["closed_version"]
    m.book.load(d["buffers"])
    for rec in d["groups"]:
        g = _Group(rec["group_id"], rec["traj_version"], rec["buffer"])
        g.occupied = rec["occupied"]
        g.live = dict.fromkeys(rec["live"])
        g.done = dict.fromkeys(rec["done"])
        m._groups[g.group_id] = g
        for t in list(g.live) + list(g.done):
            m._trajs[t] = g
    m._closed = dict.fromkeys(d["closed"])
    for gid, reason in d["aborted"]:
        m._aborted[gid] = reason
        m._finished[gid] = f"aborted: {reason}"
        m._abort_counts[reason] = m._abort_counts.get(reason, 0) + 1
    for gid, tv, bv in d["consumed"]:
        m._log.append((gid, tv, bv))
        m._finished[gid] = "consumed"
    m._member_abort_counts = dict(d["trajs_aborted_by_reason"])
    m.exchanges = int(d.get("occupy_exchanges", 0))
    m.order_swaps = int(d.get("order_swaps", 0))
    if m._seq is not None:
        m._seq = {gid: n for gid, n in d["started"]}
        m._next_seq = d["next_start"]
    return m


def validate_manager(m) -> None:
    """Recompute buffers, closed set and member index from the groups; raise on any mismatch."""

    def fail(msg):
        raise ProtocolError(f"staleness manager state is inconsistent: {msg}")

    reserved: dict = {}
    occupied: dict = {}
    n_members = 0
    for gid, g in m._groups.items():
        if gid in m._finished:
            fail(f"group {gid!r} is both live and {m._finished[gid]}")
        members = {**g.live, **g.done}
        n_members += len(g.live) + len(g.done)
        if set(g.live) & set(g.done):
            fail(f"group {gid!r} has a member both live and done")
        if g.traj_version > m.version:
            fail(f"group {gid!r} has V_traj {g.traj_version}, newer than version {m.version}")
        if len(g.done) > m.group_size or (len(g.done) == m.group_size and g.live):
            fail(f"group {gid!r} has {len(g.done)} done and {len(g.live)} live members (N={m.group_size})")
        if len(g.live) + len(g.done) > m.group_capacity:
            fail(f"group {gid!r} has more than group_capacity={m.group_capacity} members")
        if g.occupied and len(g.done) < m.group_size:
            fail(f"occupied group {gid!r} has only {len(g.done)} done members")
        for t in members:
            if m._trajs.get(t) is not g:
                fail(f"member {t!r} of group {gid!r} is not indexed")
        if g.buffer is None:
            if g.occupied or gid not in m._closed:
                fail(f"group {gid!r} has no buffer but is not in the closed set")
            continue
        if gid in m._closed:
            fail(f"closed group {gid!r} still holds buffer {g.buffer}")
        if not (max(g.traj_version, m.version) <= g.buffer <= g.traj_version + m.eta):
            fail(f"group {gid!r} (traj_version {g.traj_version}) sits in buffer {g.buffer} outside its window")
        (occupied if g.occupied else reserved).setdefault(g.buffer, set()).add(gid)
    if n_members != len(m._trajs):
        fail(f"{len(m._trajs)} indexed trajectories but {n_members} group members")
    if set(m._closed) - set(m._groups):
        fail("closed set names groups that are not live")
    for v, b in m.book.buffers.items():
        if v < m.version:
            fail(f"buffer {v} below version {m.version} still exists")
        if set(b.reserved) != reserved.pop(v, set()) or set(b.occupied) != occupied.pop(v, set()):
            fail(f"buffer {v} entries do not match the groups placed in it")
    m.book.check(fail)
    if reserved or occupied:
        fail(f"groups placed in missing buffers {sorted(set(reserved) | set(occupied))}")
    if m.closed_version > m.version:
        fail(f"closed_version {m.closed_version} > version {m.version}")
    logged = [gid for gid, _, _ in m._log]
    if len(set(logged)) != len(logged) or set(logged) & set(m._aborted):
        fail("a group is logged as consumed twice, or as both consumed and aborted")
    if set(m._finished) != set(logged) | set(m._aborted):
        fail("finished-group index does not match the consumption log and the abort record")
    if m._seq is not None:
        starts = list(m._seq.values())
        if set(m._seq) != set(m._groups):
            fail("train order 'drawn': the start numbers do not name exactly the live groups")
        if len(set(starts)) != len(starts) or not all(type(n) is int and 0 <= n < m._next_seq for n in starts):
            fail(f"train order 'drawn': start numbers must be distinct ints in [0, next_start={m._next_seq})")
    last = -1
    for gid, tv, bv in m._log:
        if not (tv <= bv <= tv + m.eta) or bv < last or bv >= m.version:
            fail(f"consumption log entry {(gid, tv, bv)} breaks the bound or the version order")
        last = bv
