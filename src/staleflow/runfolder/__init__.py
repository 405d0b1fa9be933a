"""Where a run lives on disk, below the launcher: every layer may use these, none imports launch/.

run_dir.py   the run folder (--log.run-dir/NAME): created empty, rows superseded on a resume,
             id high-water marks (ids.json), removed again when a start failed
lock.py      one writer per run folder (run.lock: flock + the holder's pid)
elastic.py   the elastic pointer (/tmp/staleflow-elastic-<id>.json): the folder an elastic
             restart continues, and the "failed on bad input" mark launch.sh reads
scratch.py   per-run scratch folders (control sockets) with their owner's pid (staleflow.pids checks it); the
             leftovers of crashed runs
"""
