import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """torch on one thread for the test (the serial kernels: decode attention, the
    weight-stream GEMVs, numpy's OpenBLAS backend), the user's count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """Tests of the timing caches see a quiet machine (the CI machine's load, and whether
    this process waited for a core, must not decide whether a timing is cached);
    test_timegate's busy-machine tests restore the real checks."""
    from opfuse.cost import device
    monkeypatch.setattr(device, "busy", lambda: None)
    monkeypatch.setattr(device, "ON_CPU_MIN", 0.0)

# Fusion decisions in the test tier are the traffic gate's (deterministic): the time gate
# (opfuse.timegate) measures regions on this machine, so golden plans and fused counts would
# depend on the machine and its load. Its own tests pass decide="time" with injected timings.
os.environ.setdefault("OPFUSE_DECIDE", "rho")
# Likewise the roofline uses the static CPU profile here (the measured one is the default).
os.environ.setdefault("OPFUSE_MEASURE_DEVICE", "0")
