"""The data plane across nodes, on real CURVE TCP sockets: records shipped into a mirror ring keep
the ring's handle semantics (same handle, stale handles refused, exactly-once frees, wrap-around);
forged or malformed shipments are dropped without killing the receiver; partial records fetched
from their producer; weights pulled over gloo from a Parameter Server that keeps publishing, each
pull one whole version."""

from __future__ import annotations

import random
import time
import uuid

import pytest
import torch
import zmq

from staleflow.net.curve import RunKeys, SecureContext, new_secret
from staleflow.servers import StaleHandle, TrajectoryRing
from staleflow.servers.mirror import attach_mirror, mirror_name, read_arrived
from staleflow.servers.segment import list_segments
from staleflow.servers.shipping import (
    Freed,
    RecordFetcher,
    RecordReceiver,
    RecordServer,
    RecordShipper,
    Shipped,
    ZeroCopySends,
    _encode,
)
from staleflow.trajectory import TrajectoryTokens

PRODUCER, OTHER, NODE = 2, 3, 0


def record(rng: random.Random, n_resp: int | None = None) -> TrajectoryTokens:
    p, r = rng.randint(1, 20), rng.randint(1, 60) if n_resp is None else n_resp
    return TrajectoryTokens(
        torch.randint(0, 1000, (p,), dtype=torch.int32),
        torch.randint(0, 1000, (r,), dtype=torch.int32),
        torch.randn(r),
        torch.randint(0, 9, (r,), dtype=torch.int32),
        torch.randint(0, 2, (r,), dtype=torch.int32) if rng.random() < 0.5 else None,
    )


def same(a: TrajectoryTokens, b: TrajectoryTokens) -> bool:
    return (
        all(
            torch.equal(x, y)
            for x, y in (
                (a.prompt_ids, b.prompt_ids),
                (a.response_ids, b.response_ids),
                (a.behaviour_logprobs, b.behaviour_logprobs),
                (a.versions, b.versions),
            )
        )
        and a.mask_values() == b.mask_values()
    )


@pytest.fixture
def link():
    """A producer ring on 'node 1' shipping to a receiver on 'node 0' (same machine, TCP between)."""
    run_id = uuid.uuid4().hex[:10]
    keys = RunKeys(new_secret(), 4)
    trainer = SecureContext(keys, "rank 0", 0)
    sock, endpoint = trainer.server(zmq.PULL, "127.0.0.1", b"records")
    ring = TrajectoryRing.create(run_id, PRODUCER, 128 << 10)  # small: wraps around often
    receiver = RecordReceiver(sock, run_id, NODE, [PRODUCER], ring.capacity)
    rollout = SecureContext(keys, "rank 2", PRODUCER)
    sends = ZeroCopySends()
    shipper = RecordShipper({NODE: rollout.client(zmq.PUSH, endpoint)}, sends)
    mirror = attach_mirror(run_id, PRODUCER, NODE, timeout=10)
    yield run_id, keys, ring, shipper, sends, receiver, mirror, endpoint
    mirror.close()
    shipper.close()
    receiver.close()
    ring.close()
    ring.unlink()
    rollout.close()
    trainer.close()
    assert not [n for n in list_segments() if run_id in n]


def _freed_in_mirror(mirror, h, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            mirror.read(h)
        except StaleHandle:
            return True
        time.sleep(0.002)
    return False


def test_multinode_shipped_records_read_back_from_the_mirror_with_the_same_handles(link):
    run_id, _, ring, shipper, sends, receiver, mirror, _ = link
    rng = random.Random(0)
    live: dict = {}
    for step in range(1200):  # random writes and frees, wrapping the 128 KiB ring several times
        if live and (rng.random() < 0.45 or len(live) > 12):
            h = rng.choice(list(live))
            sends.wait(h)  # what the rollout rank does before every free
            ring.free(h)
            shipper.freed([h])
            del live[h]
            assert _freed_in_mirror(mirror, h)  # the free followed the record to the mirror
            continue
        rec = record(rng)
        try:
            h = ring.write(rec)
        except Exception:  # RingFull: free something first
            continue
        copies, nbytes = shipper.ship(ring, h)
        assert (copies, nbytes) == (1, h.length)
        live[h] = rec
        got = read_arrived(mirror, h, timeout=10)
        assert same(got, rec), f"step {step}: mirror differs"
    for h, rec in live.items():
        assert same(mirror.read(h), rec)
    assert receiver.errors == 0 and receiver.mirrors[PRODUCER].records > 100
    with pytest.raises(StaleHandle, match="already freed"):  # exactly once, as in one node
        h = next(iter(live))
        ring.free(h)
        ring.free(h)


def test_multinode_forged_and_malformed_shipments_are_dropped_and_the_receiver_lives(link, capfd):
    run_id, keys, ring, shipper, sends, receiver, mirror, endpoint = link
    rng = random.Random(1)
    h = ring.write(record(rng))
    other = SecureContext(keys, "rank 3", OTHER)  # a rank of the run, but not ring 2's producer
    forger = other.client(zmq.PUSH, endpoint)
    forger.send_multipart([_encode(Shipped(h, ring.capacity)), bytes(ring.record_view(h))])
    forger.send(_encode(Freed([h])))
    forger.send(b"\xc1\xc1 garbage")
    deadline = time.monotonic() + 10
    while receiver.errors < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.errors == 3
    err = capfd.readouterr().err
    assert "record receiver: dropped a message" in err and "not the sender's own ring" in err, err
    with pytest.raises(StaleHandle):
        mirror.read(h)  # the forged copy was not written
    shipper.ship(ring, h)  # the producer's own shipment is
    assert same(read_arrived(mirror, h, timeout=10), ring.read(h))
    forger.close(linger=0)
    other.close()


def test_multinode_big_records_shipped_zero_copy_arrive_whole_even_when_their_space_is_reused(link):
    _, _, ring, shipper, sends, _, mirror, _ = link
    rng = random.Random(2)
    for _ in range(6):  # each above pyzmq's 64 KiB copy threshold: libzmq reads the ring itself
        rec = record(rng, n_resp=5600)
        h = ring.write(rec)
        assert h.length > 65536
        shipper.ship(ring, h)
        assert same(read_arrived(mirror, h, timeout=10), rec)
        sends.wait(h)  # the producer frees only once no send reads these bytes any more
        ring.free(h)
        shipper.freed([h])
        assert _freed_in_mirror(mirror, h)
    assert ring.live_records == 0


def test_multinode_partial_records_are_fetched_from_their_producer():
    run_id = uuid.uuid4().hex[:10]
    keys = RunKeys(new_secret(), 4)
    prod, cons = SecureContext(keys, "rank 2", 2), SecureContext(keys, "rank 3", 3)
    sock, endpoint = prod.server(zmq.ROUTER, "127.0.0.1", b"fetch")
    sends = ZeroCopySends()
    server = RecordServer(sock, sends)
    fetcher = RecordFetcher(lambda r: cons.client(zmq.DEALER, endpoint))
    rng = random.Random(3)
    with TrajectoryRing.create(run_id, 2, 1 << 20) as ring:
        recs = [record(rng) for _ in range(5)]
        hs = [ring.write(r) for r in recs]
        ring.free(hs[1])  # dropped meanwhile: the answer is None, not an error
        got = fetcher.fetch(hs, serve=lambda: server.serve(ring))
        assert got[hs[1]] is None
        assert all(same(got[h], r) for h, r in zip(hs, recs) if h != hs[1])
        assert fetcher.records == 4 and fetcher.bytes == sum(h.length for h in hs) - hs[1].length
        sends.wait_all()
    fetcher.close()
    server.close()
    prod.close()
    cons.close()
    assert mirror_name(run_id, 2, 0) not in list_segments()
