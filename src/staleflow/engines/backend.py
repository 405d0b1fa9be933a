"""The rollout-engine backend: everything one engine brings to a run, behind one registry.

    backend = engine_backend(cfg)                  # --rollout.engine: 'builtin', 'vllm' or 'pkg.module:Name'
    engine = backend.build(ctx, model, gpu_share)  # on a rollout rank (workers/rollout.py)
    source = backend.weight_source(run_id, reader, worker_reader)   # where Pulls read (servers/weights.py)
    backend.rank_loads_model                       # the rank loads the policy itself (launch/entry.py)
    backend.check_placement(topology)              # layouts it cannot run (launch/entry.py, at start)
    backend.extras                                 # packages it needs installed (staleflow check)
    backend.takes_gpu_share, backend.plan_rank(site)   # the memory plan's rows (plan/)

A backend is a class built once per use as ``cls(cfg)`` from the run's config. ``ENGINES`` is the
one registry of them: the built-ins register themselves (engines/builtin.py, engines/vllm.py) with
the same interface a fork implements, and ``--rollout.engine my_fork.engine:MyBackend`` loads a
fork's through the same path as ``--train.loss`` (staleflow.extensions). Nothing outside a backend
asks which engine runs. This module is pure: no torch, no engine imported.
"""

from __future__ import annotations

from staleflow.extensions import ExtensionError, Registry, Shape, one_line


class EngineBackend:
    """Base class of a rollout-engine backend (docs/extending.md, "A new rollout engine").

    Subclass it and override ``build`` (required) and whatever differs from the defaults below,
    which describe an engine like the built-in one: it runs on the rank's own copy of the policy
    (loaded by the rank in the rollout dtype) and offers its parameters as the targets of a pull
    (``engine.weight_targets()``).
    """

    rank_loads_model: bool = True
    """The rank loads the policy onto its device in the rollout dtype (--rollout.dtype) and hands it
    to ``build``; False: the engine loads its own weights (``build`` gets model=None)."""
    takes_gpu_share: bool = False
    """On CUDA, ``build`` gets the share of its GPU the memory plan gives the engine (a float in
    (0, 1): e.g. a library that preallocates a fraction of the device); else None."""
    loads_partial_weights: bool = False
    """Its engines' ``load_weights(tensors, version, strict=False)`` loads some of the parameters (a
    LoRA run's pulls: the adapted projections' merged weights only, docs/lora.md)."""
    extras: tuple[tuple[str, str], ...] = ()
    """(module, how to install it) for each optional package the engine needs; ``staleflow check``
    refuses the run in one line when one is missing."""

    def __init__(self, cfg):
        self.cfg = cfg

    @property
    def flag(self) -> str:
        """The flag as the user gave it, for messages: --rollout.engine=NAME."""
        return f"--rollout.engine={self.cfg.rollout.engine}"

    def build(self, ctx, model, gpu_share: float | None):
        """The engine of one rollout rank (staleflow.rollout.engine.RolloutEngine's interface: add,
        step, abort, load_weights, stats, ...). ``ctx``: the rank's context (``cfg``, ``rank``,
        ``device``, ``roles``); ``model``: the rank's policy when ``rank_loads_model``, else None."""
        raise NotImplementedError(f"{type(self).__name__}.build: a rollout-engine backend must build its engine")

    def weight_source(self, run_id: str, reader: int, worker_reader: int):
        """Where a Pull reads on the Parameter Server's node (servers/weights.py): by default this
        rank's own reader, copying into ``engine.weight_targets()``. ``worker_reader`` is the reader
        index reserved for a separate engine process of this rank (cluster/placement.reader_index)."""
        from staleflow.servers.weights import LocalWeights

        return LocalWeights(run_id, reader)

    def check_placement(self, topology) -> None:
        """Raise ConfigError (one line naming the fix) for a layout this engine cannot run; by default
        every layout the runtime accepts (cluster/topology.py: ``remote_pullers``, ``home``, ...)."""

    def plan_rank(self, site):
        """One rollout rank's memory plan (a plan.estimate.RankPlan, from ``site.new_plan()``). The
        default counts what every engine holds: the policy in the rollout dtype, one step's
        workspace and, on CUDA, the process's context. Override it to add the engine's KV cache."""
        plan = site.new_plan()
        plan.add("weights", site.weights_bytes(), f"{type(self).__name__} engine in {site.dtype}")
        plan.add("workspace", site.workspace_bytes(), "step activations and sampler (estimate)")
        if site.device_type == "cuda":
            plan.add("contexts", site.context_bytes)
        plan.load_peak = site.load_bytes() if self.rank_loads_model else 0
        plan.notes.append(f"kv_cache: {type(self).__name__} does not describe its KV cache to the plan")
        return plan.finish()


ENGINES: Registry[type[EngineBackend]] = Registry(
    "rollout engine",
    "--rollout.engine",
    Shape.klass(
        1,
        "class (cfg) with build(ctx, model, gpu_share), weight_source(run_id, reader, worker_reader), "
        "check_placement(topology), plan_rank(site) and rank_loads_model / takes_gpu_share / extras "
        "(subclass staleflow.engines.EngineBackend)",
        methods=(("build", 3), ("weight_source", 3), ("check_placement", 1), ("plan_rank", 1)),
        attrs=(("rank_loads_model", bool), ("takes_gpu_share", bool), ("extras", tuple)),
    ),
)
"""name -> backend class; docs/extending.md lists the built-ins."""


def register_engine(name: str):
    """Decorator: make a backend class available as ``--rollout.engine NAME``."""
    return ENGINES.register(name)


def engine_backend(cfg) -> EngineBackend:
    """The backend --rollout.engine names, built for ``cfg`` (a RunConfig); ExtensionError (one line,
    exit 2 from ``staleflow check``) when the spec does not resolve or the class cannot be built."""
    cls = ENGINES.resolve(cfg.rollout.engine)
    try:
        backend = cls(cfg)
    except Exception as e:  # a fork's constructor may raise anything; the message names the flag
        raise ExtensionError(
            f"--rollout.engine={cfg.rollout.engine!r}: {cls.__name__}(cfg) failed ({type(e).__name__}: "
            f"{one_line(e)}); a rollout engine is {ENGINES.shape.text}"
        ) from None
    lora = getattr(cfg, "lora", None)
    if lora is not None and lora.enabled and not getattr(backend, "loads_partial_weights", False):
        raise ExtensionError(
            f"--lora.rank {lora.rank} with --rollout.engine={cfg.rollout.engine!r}: a LoRA run's pulls carry the "
            f"adapted projections' merged weights only, which this engine cannot load: use --rollout.engine builtin"
        )
    return backend
