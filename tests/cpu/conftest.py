import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """Tests of the timing caches see a quiet machine (the CI machine's load must not decide
    whether a timing is cached); test_timegate's busy-machine test restores the real check."""
    from opfuse import gemm, timegate
    monkeypatch.setattr(gemm, "busy", lambda: None)
    monkeypatch.setattr(timegate, "busy", lambda: None)

# Fusion decisions in the test tier are the traffic gate's (deterministic): the time gate
# (opfuse.timegate) measures regions on this machine, so golden plans and fused counts would
# depend on the machine and its load. Its own tests pass decide="time" with injected timings.
os.environ.setdefault("OPFUSE_DECIDE", "rho")
# Likewise the roofline uses the static CPU profile here (the measured one is the default).
os.environ.setdefault("OPFUSE_MEASURE_DEVICE", "0")
