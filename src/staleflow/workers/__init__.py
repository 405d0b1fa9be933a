"""The rank loops: a rollout rank runs one rollout instance (engine, ring, weight source), a
trainer rank trains (FSDP2) and pushes weights; rank.py is what every rank shares.
"""
