"""StaleFlow: asynchronous, fully disaggregated RL post-training with per-trajectory bounded staleness.

Launch: ``./launch.sh`` (or ``torchrun --nproc_per_node=N -m staleflow train ...``).
The layout is the architecture: protocol/ (staleness manager), servers/ (trajectory and
parameter servers), coordinator/ (Snapshot-Command cycle), rollout/ (engines), train/
(trainer), model/ (Llama/Qwen2/Qwen3), sim/ (discrete-event simulator), launch/ (processes).
"""

__version__ = "0.1.0"
