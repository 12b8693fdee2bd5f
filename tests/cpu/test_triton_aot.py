"""Ahead-of-time compile of every shipped Triton kernel configuration for sm_90 and sm_80.

Runs ``python -m opfuse.kernels.triton.aot`` (Triton's bundled ptxas, no GPU) in a
subprocess: the interpreter tier cannot see GPU-only errors (``tl.dot`` shapes, shared
memory, register pressure). Fails on any CompilationError / ptxas error / shared memory
over the target's limit; the script prints registers, spills and shared memory per kernel
(see the captured output with ``pytest -s`` or ``-rA``). Compiles go to Triton's cache, so
a second run only re-reads the cubins.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def aot(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    proc = subprocess.run([sys.executable, "-m", "opfuse.kernels.triton.aot", "--arch", "90", "80", "--jobs", jobs,
                           "--json", str(out)], env=_env(), capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    data = json.loads(out.read_text()) if out.exists() else {}
    return proc, data


def test_every_shipped_config_compiles_for_sm90_and_sm80(aot):
    proc, data = aot
    assert data, f"aot script wrote no results (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    failed = [f"sm_{r['arch']} {r['dtype']} {r['label']}: {r.get('error')}" for r in data["results"] if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert {r["arch"] for r in data["results"]} == {90, 80}
    for r in data["results"]:  # resource figures came back from the cubin
        assert 0 < r["reg"] <= 255 and r["shared_dyn"] >= 0, r


def test_every_triton_kernel_is_in_the_aot_list():
    """A new @triton.jit kernel in opfuse/kernels/triton must get an AOT entry."""
    code = (
        "import pkgutil, importlib, opfuse.kernels.triton as P\n"
        "from opfuse.kernels.triton import aot\n"
        "jit = set()\n"
        "for m in pkgutil.iter_modules(P.__path__):\n"
        "    mod = importlib.import_module('opfuse.kernels.triton.' + m.name)\n"
        "    jit |= {f'{mod.__name__}:{n}' for n, v in vars(mod).items()\n"
        "            if type(v).__name__ == 'JITFunction' and n.endswith('_fwd_kernel') and v.__module__ == mod.__name__}\n"
        "listed = {e.kernel for e in aot.entries()}\n"
        "print(sorted(jit)); assert jit and jit <= listed, jit - listed\n"
        "assert len(aot.entries(full=True)) > len(aot.entries())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


# --- benchmarks/gpu_check.sh: its CPU-side parts (syntax, argument parsing, --dry-run) ------

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_gpu_check_sh_parses():
    proc = subprocess.run(["bash", "-n", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_check_dry_run_prints_the_plan():
    env = dict(_env(), PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for kernel in ("add_layernorm", "layernorm_gelu", "linear_bias_gelu", "linear_residual", "ffn", "attention"):
        assert kernel in out
    for section in ("correctness:", "bandwidth:", "kernels:", "e2e:"):
        assert section in out
    assert "budget 450 s" in out  # the shell wrapper's limit (470 s) minus the margin


def test_gpu_check_argument_errors_and_quick_sections():
    env = dict(_env(), PYTHON=sys.executable)
    script = os.path.join(ROOT, "benchmarks", "gpu_check.py")
    bad = subprocess.run([sys.executable, script, "--sections", "nope"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown section" in bad.stderr
    quick = subprocess.run([sys.executable, script, "--dry-run", "--quick", "--sections", "correctness,kernels",
                            "--dtypes", "float16"], env=env, capture_output=True, text=True, timeout=120)
    assert quick.returncode == 0, quick.stderr
    assert "correctness:" in quick.stdout and "e2e:" not in quick.stdout and "long-causal" not in quick.stdout
