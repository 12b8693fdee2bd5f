"""Benchmarks: opfuse vs eager, ``torch.compile`` (inductor) and ONNX Runtime on real
models; fused CPU kernels vs their unfused eager ops; Amdahl's prediction of the
whole-model speed-up from measured per-region speed-ups; θ sweeps.

Every figure is a median of interleaved runs after warm-up, reported with ratios to
eager and the machine description (:func:`opfuse.bench.machine.describe`): the target
machine is small, shared and noisy, so ratios measured in one process are the figures to
trust, not absolute milliseconds.

    machine.py   CPU model, cores, threads, library versions, load average
    timing.py    median and interleaved timing
    peers.py     the systems compared: opfuse, eager, inductor, ort (each may fail, with a reason)
    models.py    ``opfuse bench MODEL``: one table per model
    kernels.py   fused kernel vs unfused eager ops, GB/s and fraction of copy bandwidth
    amdahl.py    per-pattern share p (torch.profiler) × isolated S_fused -> predicted S_overall
    theta.py     fused regions, traffic and latency per θ
    results.py   JSON / CSV under benchmarks/results/
"""
