"""The control plane: typed messages (msgpack, no pickle), the ZeroMQ sockets that carry them,
and the controller's hub that watches every rank.
"""
