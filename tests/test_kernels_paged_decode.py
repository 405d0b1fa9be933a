"""Specification of the paged decode attention kernel (kernels/paged_decode.py) against its fp64
reference, under TRITON_INTERPRET=1 on CPU (set by conftest before import) or on CUDA.

Every case scatters each sequence's blocks at random over a cache whose other slots are NaN and
pads the block tables with an out-of-range block id, so a read outside a sequence's context
(a wrong slot, a table entry past its length, a padded lane that is not masked) shows up as NaN
or a crash. Tiny shapes: the interpreter costs milliseconds per program. The last test compiles
the kernels offline for sm_90 (no GPU needed) and checks they are pipelined and spill-free.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.kernels import paged_decode as pd
from staleflow.kernels.paged_decode import paged_decode_attention
from staleflow.kernels.reference import paged_decode_reference

pytestmark = pytest.mark.skipif(
    not pd.available(), reason="needs triton with CUDA, or TRITON_INTERPRET=1 set before import"
)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not _INTERPRET else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
"""Max abs error vs fp64 for unit-normal inputs: fp32 rounding; for 16-bit inputs the output's
own rounding (half an ulp at |o| ~ 1-2: 1e-3 fp16, 8e-3 bf16) plus the probabilities rounded to
the input dtype before p @ v (as flash-attn does)."""
BAD_BLOCK = 1 << 28


def paged_case(lens, n_heads, n_kv, head_dim, block_size, dtype=torch.float32, seed=0):
    """(q [B, Hq, D], k_cache, v_cache [slots, Hkv, D], tables int32, lens int32): each sequence's
    blocks at random places of a NaN-filled cache, tables padded with BAD_BLOCK."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 3  # spare blocks stay NaN
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), max(blocks)), BAD_BLOCK, dtype=torch.int32)
    k_cache = torch.full((num_blocks * block_size, n_kv, head_dim), float("nan"))
    v_cache = k_cache.clone()
    used = 0
    for b, (n, nb) in enumerate(zip(lens, blocks)):
        tables[b, :nb] = order[used : used + nb].int()
        used += nb
        pos = torch.arange(n)
        slots = tables[b].long()[pos // block_size] * block_size + pos % block_size
        k_cache[slots] = torch.randn(n, n_kv, head_dim, generator=g)
        v_cache[slots] = torch.randn(n, n_kv, head_dim, generator=g)
    q = torch.randn(len(lens), n_heads, head_dim, generator=g)
    to = dict(device=DEVICE)
    return (
        q.to(dtype).to(**to),
        k_cache.to(dtype).to(**to),
        v_cache.to(dtype).to(**to),
        tables.to(**to),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
    )


def check(lens, n_heads, n_kv, head_dim, block_size, dtype=torch.float32, seed=0, **kw):
    q, k, v, tables, cl = paged_case(lens, n_heads, n_kv, head_dim, block_size, dtype, seed)
    out = paged_decode_attention(q, k, v, tables, cl, block_size, **kw)
    ref = paged_decode_reference(q, k, v, tables, cl, block_size)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype], (lens, block_size, dtype, err)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference_gqa_one_token_and_block_multiples(dtype):
    # length 1, exact multiples of the block size (8, 16), one past a multiple, a ragged tail;
    # 6 query heads on 2 kv heads (G = 3, padded to 16 rows)
    check([1, 8, 16, 9, 13], n_heads=6, n_kv=2, head_dim=16, block_size=4, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partitions_are_merged(dtype):
    """Contexts longer than the partition go through the split + merge path (here 16-token
    partitions: 1 to 5 of them, the last one partial or exactly full)."""
    check([1, 16, 17, 48, 70], n_heads=4, n_kv=1, head_dim=32, block_size=8, dtype=dtype, partition=16)


def test_odd_head_dim_block_size_one_and_no_gqa():
    check([3, 1, 20], n_heads=2, n_kv=2, head_dim=24, block_size=1)  # D padded to 32, G = 1
    check([5, 12], n_heads=8, n_kv=1, head_dim=16, block_size=3, partition=16)  # MQA, block size 3


def test_a_sequence_is_bitwise_the_same_alone_and_next_to_a_long_one():
    """Alone, a short sequence is one partition written directly; next to a long one the grid has
    several partitions and its output goes through the merge: the bits must not change."""
    q, k, v, tables, cl = paged_case([11, 61], 4, 2, 16, 4, seed=3)
    both = paged_decode_attention(q, k, v, tables, cl, 4, partition=16)
    alone = paged_decode_attention(q[:1], k, v, tables[:1], cl[:1], 4, partition=16)
    assert torch.equal(both[:1], alone)
    # the same K/V moved to other blocks of a bigger cache: placement does not change the bits
    pos = torch.arange(11, device=DEVICE)
    src = tables[0].long()[pos // 4] * 4 + pos % 4
    moved = torch.tensor([[7, 2, 5]], dtype=torch.int32, device=DEVICE)
    dst = moved[0].long()[pos // 4] * 4 + pos % 4
    k2 = torch.full((40, 2, 16), float("nan"), device=DEVICE)
    v2 = k2.clone()
    k2[dst], v2[dst] = k[src], v[src]
    assert torch.equal(paged_decode_attention(q[:1], k2, v2, moved, cl[:1], 4, partition=16), alone)


def test_scale_and_bad_inputs():
    q, k, v, tables, cl = paged_case([5, 9], 4, 2, 16, 4)
    out = paged_decode_attention(q, k, v, tables, cl, 4, scale=0.3)
    assert (out.double() - paged_decode_reference(q, k, v, tables, cl, 4, scale=0.3)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention(q, k, v, tables.long(), cl, 4)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        paged_decode_attention(q, k, v, tables, cl.long(), 4)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(q[:, :3], k, v, tables, cl, 4)
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention(q.double(), k.double(), v.double(), tables, cl, 4)
    with pytest.raises(ValueError, match="multiple of block_n"):
        paged_decode_attention(q, k, v, tables, cl, 4, partition=24, block_n=16)


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
    heads=st.sampled_from([(1, 1), (4, 1), (6, 2), (4, 2), (4, 4)]),
    head_dim=st.sampled_from([16, 24, 32]),
    partition=st.sampled_from([16, 32, 512]),
    seed=st.integers(0, 1000),
)
def test_random_layouts_match_reference(lens, block_size, heads, head_dim, partition, seed):
    check(lens, heads[0], heads[1], head_dim, block_size, seed=seed, partition=partition)


# ---- offline compile for sm_90 ------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
_INTS = [
    "stride_qb",
    "stride_qh",
    "stride_ks",
    "stride_kh",
    "stride_vs",
    "stride_vh",
    "stride_tb",
    "stride_ob",
    "stride_oh",
    "num_parts",
]


def _compile_report() -> dict:
    """Compile both kernels for sm_90 at the Qwen2.5-7B head config (28 / 4 heads, D = 128, cache
    block 16) with the divisibility hints a real launch gets; report registers, spill stack,
    shared memory and async copies (software pipelining) per configuration."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

    def build(fn, sig, const, no_hint, warps):
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a not in no_hint}
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const, attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 2})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            usage = subprocess.run(
                [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
            ).stdout
        regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
        return {
            "regs": regs,
            "stack": stack,
            "shared": c.metadata.shared,
            "async_copies": c.asm["ttgir"].count("async_copy_global_to_local"),
        }

    report = {}
    for dt, warps, prec in (("bf16", 4, "tf32"), ("fp16", 4, "tf32"), ("fp32", 8, "ieee")):
        sig = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "v_ptr")}
        sig.update(
            {
                "table_ptr": "*i32",
                "lens_ptr": "*i32",
                "out_ptr": f"*{dt}",
                "m_ptr": "*fp32",
                "l_ptr": "*fp32",
                "acc_ptr": "*fp32",
                **{n: "i32" for n in _INTS},
                "scale2": "fp32",
            }
        )
        for split in (False, True):
            const = dict(
                GROUP=7,
                G_PAD=16,
                HEAD_DIM=128,
                D_PAD=128,
                BLOCK_SIZE=16,
                BLOCK_N=64,
                PART=pd.PARTITION,
                SPLIT=split,
                DOT_PREC=prec,
                UPCAST=False,
            )
            report[f"decode_{dt}_split{int(split)}"] = build(
                pd._decode_kernel, sig, const, {"num_parts", "scale2", "stride_tb"}, warps
            )
    msig = {
        "lens_ptr": "*i32",
        "out_ptr": "*bf16",
        "m_ptr": "*fp32",
        "l_ptr": "*fp32",
        "acc_ptr": "*fp32",
        "stride_ob": "i32",
        "stride_oh": "i32",
        "num_parts": "i32",
        "num_heads": "i32",
    }
    report["merge"] = build(
        pd._merge_kernel, msig, dict(HEAD_DIM=128, D_PAD=128, PART=pd.PARTITION), {"num_parts", "num_heads"}, 4
    )
    return report


def _offline_compiler_missing() -> str | None:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception as exc:
        return f"triton offline compiler unavailable: {exc}"
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        return "triton wheel without the bundled NVIDIA tools"
    return None


@pytest.mark.skipif(_offline_compiler_missing() is not None, reason=str(_offline_compiler_missing()))
def test_kernels_compile_for_sm90_pipelined_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in report.items():
        assert r["stack"] == 0, f"{name}: register spills: {r}"
        if name.startswith("decode"):
            assert r["async_copies"] >= 2, f"{name}: K/V loads not software-pipelined: {r}"


if __name__ == "__main__":
    print(json.dumps(_compile_report()))
