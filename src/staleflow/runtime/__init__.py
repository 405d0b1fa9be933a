"""The controller process of a real run: the training job that drives the controller loop over
the real ranks (backend.py), held-out evaluation, and the process's main.
"""
