"""Networking between nodes: which interface to bind, per-run CURVE keys, and the gatekeeper that
admits only this run's ranks to a TCP socket (docs/multinode.md)."""
