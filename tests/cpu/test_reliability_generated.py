"""Hypothesis-generated small programs with in-place writes to inputs and buffers, views
taken before and after the writes, and fusable add+LayerNorm / linear+add+LayerNorm
regions between them: the fused module (both entry points) equals an eager twin on the
outputs, on what each call writes into its inputs and buffers, over repeated calls; the
eager float32 result is itself checked against a float64 run of the same program."""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opfuse
import opfuse.backend as backend

STEPS = ["add_ln", "lin_add_ln", "write_input", "view_then_write", "write_buffer", "read_buffer", "write_buffer_slot"]
D = 16


class Program(torch.nn.Module):
    """Runs ``steps`` on (x, r): x is the running value, r an input the program may write."""

    def __init__(self, steps: list[str]):
        super().__init__()
        self.steps = list(steps)
        self.lns = torch.nn.ModuleList(torch.nn.LayerNorm(D) for _ in steps)
        self.lins = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in steps)
        for ln in self.lns:  # non-trivial affine parameters
            torch.nn.init.uniform_(ln.weight, 0.5, 1.5)
            torch.nn.init.uniform_(ln.bias, -0.5, 0.5)
        self.register_buffer("acc", torch.zeros(D))
        self.register_buffer("slots", torch.zeros(3, D))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x, r):
        for i, step in enumerate(self.steps):
            if step == "add_ln":
                x = self.lns[i](x + r)
            elif step == "lin_add_ln":
                x = self.lns[i](self.lins[i](x) + r)
            elif step == "write_input":
                r.mul_(0.5).add_(x)
            elif step == "view_then_write":
                v = r.view(-1, D)
                r.sub_(1.0)
                x = self.lns[i](x + v.view_as(x))
            elif step == "write_buffer":
                self.acc.add_(x.mean(0))
            elif step == "read_buffer":
                x = self.lns[i](x + self.acc)
            elif step == "write_buffer_slot":
                self.slots.index_copy_(0, self.step.view(1) % 3, x[:1])
                self.step += 1
                x = x + self.slots.sum(0)
        return x


def _state(m):
    return [b.clone() for b in m.buffers()]


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.sampled_from(STEPS), min_size=2, max_size=6), seed=st.integers(0, 2**16),
       entry=st.sampled_from(["optimize", "compile"]))
def test_generated_programs_with_writes_equal_eager(steps, seed, entry):
    torch.manual_seed(seed)
    model = Program(steps).eval()
    twin, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    x, r = torch.randn(4, D), torch.randn(4, D)
    r_example, state_example = r.clone(), _state(model)
    if entry == "optimize":
        fused = opfuse.optimize(model, (x, r))
        assert torch.equal(r, r_example), "optimize wrote into the example input"
        assert all(torch.equal(a, b) for a, b in zip(_state(model), state_example)), "optimize moved the buffers"
    else:
        backend.reset()
        fused = torch.compile(model, backend="opfuse")
    for call in range(3):
        r_f, r_e, r_64 = r_example.clone(), r_example.clone(), r_example.double()
        with torch.no_grad():
            out, expected, ref64 = fused(x, r_f), twin(x, r_e), exact(x.double(), r_64)
        eager_err = (expected.double() - ref64).abs().max().item()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{steps} call {call}: {m}")
        assert (out.double() - ref64).abs().max().item() <= max(1e-4, 4 * eager_err)
        torch.testing.assert_close(r_f, r_e, rtol=1e-5, atol=1e-5)
        for a, b in zip(_state(model), _state(twin)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if entry == "optimize":
        assert fused.replans == [], fused.replans  # writes by the program never re-plan
