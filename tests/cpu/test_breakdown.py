"""opfuse.bench.breakdown: a forward's CPU time split into GEMM / attention / fused /
other ATen / overhead, from torch.profiler. Asserted on structure and on what the split
must contain (a sleep is overhead, a fused op's GEMM is GEMM), never on absolute speed."""

import json
import time

import torch
import torch.nn.functional as F

from opfuse.bench.breakdown import CATEGORIES, breakdown, category

ops = torch.ops.opfuse


def test_categories_by_op_name():
    assert category("aten::addmm") == category("mkldnn::_linear_pointwise") == category("aten::bmm") == "GEMM"
    assert category("aten::scaled_dot_product_attention") == category("opfuse::attention") == "attention"
    assert category("opfuse::linear_add_layernorm") == category("opfuse::rmsnorm") == "fused"
    assert category("aten::layer_norm") == category("aten::view") == "other ATen"


def test_split_of_a_known_call():
    x, w, b = torch.randn(64, 96), torch.randn(96, 96) * 0.1, torch.randn(96)
    r, g = torch.randn(64, 96), torch.randn(96)
    q = torch.randn(1, 2, 16, 8)

    def fn():
        y = F.linear(x, w, b)                                          # GEMM
        y = ops.linear_add_layernorm(y, w, b, r, g, None, 1e-5)        # GEMM inside + fused LayerNorm
        F.scaled_dot_product_attention(q, q, q)                        # attention
        y = F.layer_norm(y, (96,))                                     # other ATen
        time.sleep(0.003)                                              # no op: overhead
        return y

    res = breakdown(fn, calls=3, warmup=1)
    per = res["per_call_s"]
    assert set(per) == set(CATEGORIES) == set(res["share"])
    assert res["ops_per_call"] == 4  # the four top-level ops; their children are not counted
    assert all(per[c] > 0 for c in CATEGORIES)
    assert per["overhead"] >= 0.0025  # the sleep
    assert abs(sum(per.values()) - res["total_s"]) < 1e-9 and abs(sum(res["share"].values()) - 1) < 1e-9
    top = {name: cat for name, cat, _, _ in res["top"]}
    assert top["opfuse::linear_add_layernorm"] == "fused" and top["aten::linear"] == "GEMM"
    json.dumps(res)  # plain data


def test_gemm_inside_a_fused_op_counts_as_gemm():
    x, w = torch.randn(256, 384), torch.randn(384, 384) * 0.05
    r, g = torch.randn(256, 384), torch.randn(384)
    res = breakdown(lambda: ops.linear_add_layernorm(x, w, None, r, g, None, 1e-5), calls=3, warmup=1)
    per = res["per_call_s"]
    assert per["GEMM"] > 0 and per["fused"] > 0 and per["other ATen"] == 0 and per["attention"] == 0
    assert res["ops_per_call"] == 1
