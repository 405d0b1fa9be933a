"""Role dispatch of the training runtime: which loop a rank runs, and the controller's job.

    trainer ranks  -> staleflow.launch.trainer_worker.TrainerWorker
    rollout ranks  -> staleflow.launch.rollout_worker.RolloutWorker
    controller     -> staleflow.launch.job.TrainingJob
Workers are built before the rank reports Ready (rings and the Parameter Server exist by then),
and run after the controller's Welcome.
"""

from __future__ import annotations


def make_worker(ctx, model):
    """Build the rank's worker; returns (worker, extra Ready info)."""
    if ctx.role == "trainer":
        from staleflow.launch.trainer_worker import TrainerWorker

        w = TrainerWorker(ctx, model)
        return w, {"version": w.trainer.version, "resume_extra": w.resume_extra if ctx.rank == 0 else {}}
    from staleflow.launch.rollout_worker import RolloutWorker

    w = RolloutWorker(ctx, model)
    return w, {"instance": w.instance}


def training_job(ctl, cfg) -> None:
    from staleflow.launch.job import TrainingJob

    TrainingJob(ctl, cfg).run()
