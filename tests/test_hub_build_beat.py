"""While the controller builds its job (tokenizer, data, reward pool) it is busy without the hub:
Hub.beating() keeps heartbeats going, so ranks do not give up on it during a long build."""

from __future__ import annotations

import os
import time
import uuid

from staleflow.cluster.roles import Roles
from staleflow.control.hub import Hub
from staleflow.control.messages import Heartbeat, Ping
from staleflow.control.sockets import ControlClient, control_address
from staleflow.runfolder.scratch import remove_run_folder


def test_hub_beats_while_the_job_is_built_and_the_socket_stays_usable():
    ctl = Hub(run_id=uuid.uuid4().hex[:10], roles=Roles(3, 2), parent_pid=os.getppid())
    client = ControlClient(control_address(ctl.run_id), 1)
    try:
        beats = 0
        with ctl.beating(every_s=0.2):
            time.sleep(0.3)  # the client connects meanwhile
            deadline = time.monotonic() + 3.0
            while beats < 3 and time.monotonic() < deadline:  # the main thread is busy elsewhere
                msg = client.recv(0.5)
                beats += isinstance(msg, Heartbeat)
            ctl.send(1, Ping(rank=-1, seq=7, payload="x"))  # the job may use the hub meanwhile
        assert beats >= 3
        got = None
        deadline = time.monotonic() + 3.0
        while not isinstance(got, Ping) and time.monotonic() < deadline:
            got = client.recv(0.5)
        assert isinstance(got, Ping) and got.seq == 7
        assert type(ctl.server).__name__ == "ControlServer"  # the lock is gone after the build
    finally:
        client.close()
        ctl.close()
        remove_run_folder(ctl.run_id)
