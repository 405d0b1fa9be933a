"""The cluster section of a run (``--cluster.sharding hsdp``): how the trainer group spreads over nodes
(docs/multinode.md). Where ranks run is torchrun's; this says how the trainer shards across them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ClusterConfig:
    """Trainer sharding across nodes."""

    sharding: Literal["fsdp", "hsdp"] = "fsdp"
    """fsdp: one FSDP2 group shards every weight over all trainer ranks, on every node (least memory;
    every node's trainer ranks hold their rows of the Parameter Server). hsdp: shard within each node,
    replicate across nodes (gradients all-reduced between replicas; every trainer node holds every
    weight, so rollout ranks on a trainer node pull nothing over the network). On one node both are
    the same."""
