"""Ahead-of-time compile of every shipped Triton kernel configuration, no GPU needed.

    python -m opfuse.kernels.triton.aot [--arch 90 80] [--jobs N] [--full] [--json out.json]

Each entry is (kernel, pointer dtypes, constexprs, num_warps, num_stages) exactly as the
launchers choose them (their ``config`` functions / ``_gemm.configs``), plus representative
int arguments specialised as the JIT does at run time (an int == 1 becomes a constexpr,
a multiple of 16 and every pointer get ``tt.divisibility`` 16), so register and spill
figures are those of the kernels that really run. Compiles with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` through Triton's
bundled ptxas, then reads registers / stack (spills) / static shared memory back from the
cubin with the bundled ``cuobjdump -res-usage``; Triton's dynamic shared memory is
``metadata.shared``. Exit status 1 if any entry fails to compile (``CompilationError`` or a
ptxas error) or needs more shared memory than the target has.

The default list covers every launch config and every constexpr value at least once per
I/O dtype on realistic row widths / head dims; ``--full`` compiles the cross product
(slow: 2-10 s per attention compile on these CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
os.environ.pop("TRITON_INTERPRET", None)  # compile the GPU configs, not the interpreter's

import torch  # noqa: E402

_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Opt-in shared memory per block (bytes): sm_80 A100 164 KiB - 1 KiB reserved, sm_90 H100/H200 228 KiB - 1 KiB.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


@dataclass(frozen=True)
class Entry:
    kernel: str  # module:function
    label: str
    dtype: str  # "fp16" | "bf16" | "fp32"
    pointers: tuple[tuple[str, str], ...]  # (arg, triton pointer type)
    floats: tuple[str, ...]
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int = field(default=1)
    ints: tuple[tuple[str, int], ...] = ()  # representative int args (others: 17, unaligned)


def _split(cfg: dict) -> tuple[dict, int, int]:
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    return meta, cfg.get("num_warps", 4), cfg.get("num_stages", 1)


def entries(full: bool = False) -> list[Entry]:
    from opfuse.kernels.triton import _gemm, add_layernorm, attention, layernorm_gelu, linear_add_layernorm, rope

    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    out: list[Entry] = []

    # --- row kernels: one config per row width (BLOCK_N, warps); flags as constexprs
    widths = [384, 768, 1024, 4096, 8192] if full else None
    row_cases = (
        [(dt, n, f1, f2) for dt in dtypes for n in widths for f1 in (False, True) for f2 in (False, True)]
        if full
        else [(torch.float16, 768, True, True), (torch.bfloat16, 4096, False, True),
              (torch.float32, 384, True, False), (torch.bfloat16, 8192, True, False)]
    )
    for dt, n, has_bias, flag in row_cases:
        p = _PTR[dt]
        meta, w, s = _split(add_layernorm.config(n))
        out.append(Entry(
            "opfuse.kernels.triton.add_layernorm:_add_layernorm_fwd_kernel",
            f"add_layernorm N={n} bias={int(has_bias)} sum={int(flag)}", _SHORT[dt],
            tuple((a, p) for a in ("X", "R", "W", "B", "Out", "S")), ("eps",),
            tuple(dict(HAS_BIAS=has_bias, EMIT_SUM=flag, **meta).items()), w, s,
            (("stride_x", n), ("stride_r", n), ("N", n))))
        meta, w, s = _split(layernorm_gelu.config(n))
        act = 2 if flag else 1
        out.append(Entry(
            "opfuse.kernels.triton.layernorm_gelu:_layernorm_gelu_fwd_kernel",
            f"layernorm_gelu N={n} bias={int(has_bias)} {'tanh' if act == 2 else 'erf'}", _SHORT[dt],
            tuple((a, p) for a in ("X", "W", "B", "Out")), ("eps",),
            tuple(dict(HAS_BIAS=has_bias, ACT=act, **meta).items()), w, s, (("stride_x", n), ("N", n))))
        meta, w, s = _split(linear_add_layernorm.config(n))  # ACT_NONE: linear_add_layernorm's norm pass
        out.append(Entry(
            "opfuse.kernels.triton.layernorm_gelu:_layernorm_gelu_fwd_kernel",
            f"layernorm N={n} bias={int(has_bias)} (linear_add_layernorm)", _SHORT[dt],
            tuple((a, p) for a in ("X", "W", "B", "Out")), ("eps",),
            tuple(dict(HAS_BIAS=has_bias, ACT=0, **meta).items()), w, s, (("stride_x", n), ("N", n))))

    # --- rope: one config per head dim; both layouts
    rope_cases = ([(dt, d, il) for dt in dtypes for d in (64, 80, 128, 256) for il in (False, True)] if full
                  else [(torch.float16, 64, False), (torch.bfloat16, 128, True), (torch.float32, 128, False),
                        (torch.bfloat16, 80, False)])
    for dt, d, interleaved in rope_cases:
        p = _PTR[dt]
        meta, w, s = _split(rope.config(d))
        out.append(Entry(
            "opfuse.kernels.triton.rope:_rope_fwd_kernel",
            f"rope D={d} {'interleaved' if interleaved else 'rotate_half'}", _SHORT[dt],
            (("X", p), ("C", p), ("Sn", p), ("Out", p)), (),
            tuple(dict(INTERLEAVED=interleaved, **meta).items()), w, s,
            (("H", 32), ("S", 509), ("D", d), ("sxb", 509 * 32 * d), ("sxh", d), ("sxs", 32 * d), ("scb", 0),
             ("scs", d), ("ssb", 0), ("sss", d))))

    # --- GEMM epilogue: every autotune config of each dtype; epilogue flags rotate
    flag_sets = [(True, 1, False), (True, 0, True), (True, 2, False), (False, 0, True)]  # bias, act, residual
    for dt in dtypes:
        for i, cfg in enumerate(_gemm.configs(dt)):
            meta, w, s = _split(cfg)
            for has_bias, act, has_res in (flag_sets if full else [flag_sets[(i + dtypes.index(dt)) % 4]]):
                p = _PTR[dt]
                label = "gemm_epilogue {BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**meta)
                label += f" bias={int(has_bias)} act={('none', 'erf', 'tanh')[act]} res={int(has_res)}"
                out.append(Entry(
                    "opfuse.kernels.triton._gemm:_gemm_epilogue_fwd_kernel", label, _SHORT[dt],
                    tuple((a, p) for a in ("X", "W", "Bias", "Res", "Out")), (),
                    tuple(dict(HAS_BIAS=has_bias, ACT=act, HAS_RESIDUAL=has_res, IEEE=dt == torch.float32,
                               DOT_F32=False, **meta).items()), w, s,
                    (("M", 4097), ("N", 3072), ("K", 768), ("M_BUCKET", 8192), ("stride_xm", 768), ("stride_xk", 1),
                     ("stride_wn", 768), ("stride_wk", 1), ("stride_rm", 3072), ("stride_rn", 1))))

    # --- attention: one config per (dtype, head-dim class); mask kinds / causal rotate
    att_cases = (
        [(dt, d, mk, c) for dt in dtypes for d in (32, 64, 80, 128, 256)
         for mk, c in ((0, False), (0, True), (1, False), (2, False))]
        if full
        else [(torch.float16, 64, 2, False), (torch.bfloat16, 128, 0, True), (torch.float16, 128, 1, False),
              (torch.float32, 64, 0, False), (torch.bfloat16, 32, 1, False), (torch.bfloat16, 256, 0, True)]
    )
    for dt, d, mask_kind, causal in att_cases:
        p = _PTR[dt]
        meta, w, s = _split(attention.config(dt, d, d, masked=mask_kind != 0))
        mask_ptr = "*u8" if mask_kind == 2 else p
        out.append(Entry(
            "opfuse.kernels.triton.attention:_attention_fwd_kernel",
            f"attention D={d} mask={('none', 'add', 'bool')[mask_kind]} causal={int(causal)} "
            f"{meta['BLOCK_M']}x{meta['BLOCK_N']}",
            _SHORT[dt], (("Q", p), ("K", p), ("V", p), ("Mask", mask_ptr), ("Out", p)), ("scale",),
            tuple(dict(MASK_KIND=mask_kind, IS_CAUSAL=causal, IEEE=dt == torch.float32, DOT_F32=False,
                       **meta).items()), w, s,
            (("sqb", 12 * 509 * d), ("sqh", 509 * d), ("sqm", d), ("sqd", 1), ("skb", 4 * 509 * d), ("skh", 509 * d),
             ("skn", d), ("skd", 1), ("svb", 4 * 509 * d), ("svh", 509 * d), ("svn", d), ("svd", 1),
             ("smb", 509 * 509), ("smh", 0), ("smm", 509), ("smn", 1), ("H", 12), ("GROUP", 3),
             ("Sq", 509), ("Sk", 509), ("D", d), ("Dv", d))))
    return out


def _gpu_target(arch: int):
    try:
        from triton.backends.compiler import GPUTarget  # triton 3.x
    except ImportError:  # pragma: no cover - older layouts
        from triton.compiler import GPUTarget
    return GPUTarget("cuda", arch, 32)


def _resource_usage(cubin: bytes) -> dict:
    """REG / STACK / SHARED / LOCAL of the cubin's kernel via the bundled cuobjdump."""
    from triton.backends.nvidia import compiler as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in found.items()}


def compile_entry(entry: Entry, arch: int) -> dict:
    """Compile one entry for sm_<arch>; never raises (the error goes into the result)."""
    import importlib

    import triton
    from triton.compiler import ASTSource

    mod_name, fn_name = entry.kernel.split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    constexprs = dict(entry.constexprs)
    pointers = dict(entry.pointers)
    ints = dict(entry.ints)
    signature, attrs = {}, {}
    for i, p in enumerate(fn.params):  # the JIT's specialisation (runtime/jit.py, backends/compiler.py)
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name in pointers:
            signature[p.name] = pointers[p.name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif p.name in entry.floats:
            signature[p.name] = "fp32"
        elif ints.get(p.name, 17) == 1:
            signature[p.name] = "constexpr"
            constexprs[p.name] = 1
        else:
            signature[p.name] = "i32"
            if ints.get(p.name, 17) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    result = dict(label=entry.label, dtype=entry.dtype, arch=arch, num_warps=entry.num_warps,
                  num_stages=entry.num_stages, ok=False)
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=_gpu_target(arch),
            options=dict(num_warps=entry.num_warps, num_stages=entry.num_stages),
        )
        usage = _resource_usage(compiled.asm["cubin"])
        shared = int(compiled.metadata.shared)
        limit = MAX_SHARED.get(arch, 49152)
        result.update(usage, shared_dyn=shared, ok=shared <= limit)
        if shared > limit:
            result["error"] = f"needs {shared} B shared memory > {limit} B on sm_{arch}"
    except Exception as e:  # CompilationError, ptxas failures (RuntimeError), ...
        result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def _run(args: tuple[Entry, int]) -> dict:
    return compile_entry(*args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (default 90 80)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    ap.add_argument("--full", action="store_true", help="compile the full cross product of constexprs")
    ap.add_argument("--json", help="also write the results as JSON to this path")
    ap.add_argument("--list", action="store_true", help="print the entries and exit")
    args = ap.parse_args(argv)

    import triton

    todo = [(e, arch) for arch in args.arch for e in entries(args.full)]
    if args.list:
        for e, arch in todo:
            print(f"sm_{arch} {e.dtype:5s} {e.label}  warps={e.num_warps} stages={e.num_stages}")
        return 0
    print(f"triton {triton.__version__}, torch {torch.__version__}: compiling {len(todo)} kernels "
          f"for {', '.join(f'sm_{a}' for a in args.arch)} with {args.jobs} jobs", flush=True)
    t0 = time.perf_counter()
    if args.jobs > 1:
        import multiprocessing as mp

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            results = list(pool.map(_run, todo))
    else:
        results = [compile_entry(e, arch) for e, arch in todo]

    header = f"{'arch':6s} {'dtype':5s} {'kernel configuration':58s} {'w':>2s} {'st':>2s} {'regs':>4s} {'spill':>5s} {'smem':>7s} {'s':>5s}"
    print(header)
    print("-" * len(header))
    for r in results:
        status = "" if r["ok"] else f"  FAILED: {r.get('error')}"
        regs = r.get("reg", "?")
        spill = r.get("stack", 0) + r.get("local", 0) if "reg" in r else "?"
        smem = r.get("shared_dyn", 0) + r.get("shared", 0) if "reg" in r else "?"
        print(f"sm_{r['arch']:<3d} {r['dtype']:5s} {r['label']:58s} {r['num_warps']:>2d} {r['num_stages']:>2d} "
              f"{regs!s:>4s} {spill!s:>5s} {smem!s:>7s} {r['seconds']:5.1f}{status}")
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} compiled in {time.perf_counter() - t0:.1f} s"
          + (f"; {len(failed)} FAILED" if failed else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, results=results), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
