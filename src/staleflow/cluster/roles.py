"""Role assignment for a torchrun world: trainer ranks first, then rollout ranks (pure).

    ranks 0 .. N-R-1 : trainer ranks (one FSDP2 group); rank 0 is the trainer leader
    ranks N-R .. N-1 : rollout ranks, one rollout instance each
The controller is not a rank: global rank 0 starts it as a separate process.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.config import ConfigError


@dataclass(frozen=True)
class Roles:
    world_size: int
    num_rollout: int

    def __post_init__(self):
        if self.num_rollout < 1:
            raise ConfigError(f"--rollout.ranks={self.num_rollout} is invalid: need at least 1 rollout rank")
        if self.world_size < self.num_rollout + 1:
            raise ConfigError(
                f"world size {self.world_size} is too small for --rollout.ranks={self.num_rollout}: need at least "
                f"{self.num_rollout + 1} processes (1 trainer + {self.num_rollout} rollout); "
                f"raise --nproc_per_node or lower --rollout.ranks"
            )

    @property
    def num_trainer(self) -> int:
        return self.world_size - self.num_rollout

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(self.num_trainer))

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.num_trainer, self.world_size))

    def role(self, rank: int) -> str:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")
        return "trainer" if rank < self.num_trainer else "rollout"

    def instance_id(self, rank: int) -> int:
        """Rollout instance index (0-based) of a rollout rank."""
        if self.role(rank) != "rollout":
            raise ValueError(f"rank {rank} is a trainer rank, not a rollout rank")
        return rank - self.num_trainer

    def is_leader(self, rank: int) -> bool:
        return rank == 0
