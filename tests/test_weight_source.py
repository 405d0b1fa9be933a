"""The one weight source of a rollout rank and the one torn-read retry loop behind every reader."""

from __future__ import annotations

import uuid

import pytest
import torch

from staleflow.rollout.builtin_engine import BuiltinEngine
from staleflow.servers import ParameterServer, ParamLayout, TornRead, VersionNotFound
from staleflow.servers.slot import read_clean
from staleflow.servers.weights import EngineLoadsItself, LocalWeights, RemoteSource, open_weight_source


def _backend(engine: str):
    from staleflow.config import RolloutConfig, RunConfig
    from staleflow.engines import engine_backend

    return engine_backend(RunConfig(rollout=RolloutConfig(engine=engine)))


def _script(outcomes):
    """A read() that answers from a list (True clean, False torn, None gone), recording versions."""
    seen = []

    def read(v):
        seen.append(v)
        got = outcomes.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    return read, seen


def test_read_clean_retries_torn_copies_and_follows_the_newest_version():
    versions = iter([3, 3, 4])
    read, seen = _script([False, None, True])
    assert read_clean(read, lambda: next(versions), 5, "x") == 4 and seen == [3, 3, 4]
    read, seen = _script([TornRead("changed"), VersionNotFound("gone"), True])
    assert read_clean(read, lambda: 7, 3, "x") == 7 and seen == [7, 7, 7]


def test_read_clean_gives_up_in_one_line():
    read, _ = _script([False] * 3)
    with pytest.raises(TornRead, match=r"^pull: the slot changed during each of 3 copies"):
        read_clean(read, lambda: 1, 3, "pull")
    read, _ = _script([None])
    with pytest.raises(VersionNotFound, match=r"pull\(2\): version 2 is not available any more"):
        read_clean(read, lambda: 2, 3, "pull(2)", follow_newest=False)
    with pytest.raises(VersionNotFound, match="no version has been published yet"):
        read_clean(read, lambda: None, 3, "pull")


def _engine(seed: int) -> BuiltinEngine:
    from staleflow.model import ModelArgs
    from staleflow.model.transformer import CausalLM

    torch.manual_seed(seed)
    args = ModelArgs(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
    )
    return BuiltinEngine(CausalLM(args), max_running=2, max_kv_tokens=64, block_size=8, max_model_len=32)


def test_local_weights_copy_a_published_version_into_the_engine():
    run = "w" + uuid.uuid4().hex[:10]
    src, dst = _engine(1), _engine(2)
    named = dict(src.model.named_parameters())
    ps = ParameterServer.create(run, ParamLayout.from_named_tensors(named))
    try:
        ps.begin_push(3)
        for name, t in named.items():
            ps.write_shard(name, t.detach())
        ps.publish(3)
        source = open_weight_source(run, _backend("builtin"), reader=0, worker_reader=0)
        assert isinstance(source, LocalWeights)
        version, nbytes, by_node = source.load(dst, keep_kv=False)
        assert (version, nbytes, by_node) == (3, ps.layout.nbytes, {0: ps.layout.nbytes}) and dst.version == 3
        got = dict(dst.model.named_parameters())
        assert all(torch.equal(got[k], v) for k, v in named.items())
        source.close()
    finally:
        ps.close()


class _Remote:
    """RemoteWeights' surface: a layout, a device, pull_latest into given tensors."""

    def __init__(self, named):
        self.named, self.layout, self.device = named, None, torch.device("cpu")

    def latest_version(self):
        self.layout = ParamLayout.from_named_tensors(self.named)
        return 5

    def pull_latest(self, out):
        for k, t in out.items():
            t.copy_(self.named[k])
        return 5, {0: 100, 1: 23}


class _EngineWithoutTargets:
    """vLLM's surface: no tensors to copy into; load_weights takes the source's tensors."""

    version = 0

    def weight_targets(self):
        return None

    def load_weights(self, tensors, version, keep_kv=False):
        self.loaded, self.version, self.keep_kv = {k: t.clone() for k, t in tensors.items()}, version, keep_kv


def test_a_remote_source_stages_for_an_engine_that_holds_its_weights_elsewhere():
    named = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}
    engine = _EngineWithoutTargets()
    source = open_weight_source("r", _backend("vllm"), reader=0, worker_reader=1, remote=_Remote(named))
    assert isinstance(source, RemoteSource)
    assert source.load(engine, keep_kv=True) == (5, 123, {0: 100, 1: 23})
    assert engine.version == 5 and engine.keep_kv and all(torch.equal(engine.loaded[k], v) for k, v in named.items())
    own = open_weight_source("r", _backend("vllm"), reader=0, worker_reader=1)
    assert isinstance(own, EngineLoadsItself) and own.worker_reader == 1  # the engine's worker reads as itself
