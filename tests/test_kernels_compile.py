"""The Triton kernels compile for an H100/H200 (sm_90) without a GPU, and compile *well*.

Triton's offline compiler (ASTSource + GPUTarget + the bundled ptxas) runs on CPU. This catches
what the interpreter cannot: globals that are not tl.constexpr, unsupported ops, and performance
cliffs visible in the compiled code: the K loop must be software-pipelined (cp.async into
shared memory), use Hopper wgmma, and spill no registers. Arguments get the same divisibility-16
hints the JIT gives real launches (aligned pointers, H, V, T, strides multiple of 16).
Run in a subprocess because the test session imports the kernels under TRITON_INTERPRET=1.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_PTR = {"h_ptr": "*bf16", "w_ptr": "*bf16", "tgt_ptr": "*i64", "rows_ptr": "*i32"}


def _kernel_specs():
    """(kernel name, signature, runtime args without the divisibility hint, constexprs, warps, stages)."""
    from staleflow.kernels.logprob import KernelConfig

    cfg = KernelConfig()
    fwd_sig = {
        **_PTR,
        "n_active_ptr": "*i32",
        "part_ptr": "*fp32",
        "T": "i32",
        "V": "i32",
        "H": "i32",
        "stride_h": "i32",
        "stride_w": "i32",
        "scale2": "fp32",
        "BLOCKS_PER_SPLIT": "i32",
    }
    fwd_const = {
        "NUM_SPLITS": cfg.num_splits,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "DOT_PREC": "tf32",
        "UPCAST": False,
    }
    merge_sig = {
        "part_ptr": "*fp32",
        "mask_ptr": "*i1",
        "pos_ptr": "*i32",
        "tgt_ptr": "*i64",
        "logp_ptr": "*fp32",
        "ent_ptr": "*fp32",
        "lse2_ptr": "*fp32",
        "ez2_ptr": "*fp32",
        "T": "i32",
        "V": "i32",
    }
    merge_const = {"HAS_MASK": True, "NUM_SPLITS": cfg.num_splits, "BLOCK_T": 64}
    bwd_sig = {
        **_PTR,
        "lse2_ptr": "*fp32",
        "ez2_ptr": "*fp32",
        "glp_ptr": "*fp32",
        "gent_ptr": "*fp32",
        "dz_ptr": "*bf16",
        "row_start": "i32",
        "n_rows": "i32",
        "V": "i32",
        "H": "i32",
        "stride_h": "i32",
        "stride_w": "i32",
        "stride_dz": "i32",
        "scale2": "fp32",
        "inv_temp": "fp32",
    }
    bwd_const = {
        "BLOCK_M": cfg.bwd_block_m,
        "BLOCK_N": cfg.bwd_block_n,
        "BLOCK_K": cfg.bwd_block_k,
        "GROUP_M": cfg.bwd_group_m,
        "DOT_PREC": "tf32",
        "UPCAST": False,
    }
    return [
        ("fwd_partials_kernel", fwd_sig, {"scale2", "BLOCKS_PER_SPLIT"}, fwd_const, cfg.num_warps, cfg.num_stages),
        ("fwd_merge_kernel", merge_sig, set(), merge_const, 4, 3),
        ("bwd_dz_kernel", bwd_sig, {"scale2", "inv_temp", "n_rows"}, bwd_const, cfg.bwd_num_warps, cfg.bwd_num_stages),
    ]


def _compile_all() -> dict:
    """Compile each kernel for sm_90; report pipelining, wgmma, registers and spill stack."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from staleflow.kernels import logprob_kernels as k

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    report = {}
    for name, sig, no_hint, const, warps, stages in _kernel_specs():
        fn = getattr(k, name)
        full_sig = {**sig, **{c: "constexpr" for c in const}}
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a not in no_hint}
        src = ASTSource(fn=fn, signature=full_sig, constexprs=const, attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        ttgir = c.asm["ttgir"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            usage = subprocess.run(
                [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
            ).stdout
        regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
        report[name] = {
            "async_copies": ttgir.count("async_copy_global_to_local"),
            "wgmma": ttgir.count("warp_group_dot "),
            "regs": regs,
            "stack": stack,
            "shared": c.metadata.shared,
        }
    return report


def _offline_compiler_available() -> str | None:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception as exc:
        return f"triton offline compiler unavailable: {exc}"
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        return "triton wheel without the bundled NVIDIA tools"
    return None


@pytest.mark.skipif(_offline_compiler_available() is not None, reason=str(_offline_compiler_available()))
def test_kernels_compile_for_sm90_pipelined_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("fwd_partials_kernel", "bwd_dz_kernel"):
        r = report[name]
        assert r["wgmma"] >= 1, f"{name}: no Hopper wgmma: {r}"
        assert r["async_copies"] >= 2, f"{name}: K loop not software-pipelined: {r}"
        assert r["stack"] == 0, f"{name}: register spills: {r}"
    assert report["fwd_merge_kernel"]["stack"] == 0, report


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
