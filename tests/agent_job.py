"""A minimal torchrun worker for the agent tests (test_rendezvous_guard.py): ties itself to its agent
like a staleflow rank, writes its pid to argv[1] and sleeps until killed (at most argv[2] seconds)."""

import os
import sys
import time

from staleflow.launch.lifeline import tie_to_agent

if __name__ == "__main__":
    tie_to_agent()
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(float(sys.argv[2]))
