"""Attention core: QKᵀ → scale → (+mask) → softmax → ·V as one fused call that never
writes the S×S score matrix (FlashAttention, Dao et al. 2022; on CPU ATen's
``scaled_dot_product_attention``).

Eager spelling (BERT ``attn_implementation="eager"``; dropout is removed in eval by
canonicalisation; ``/ sqrt(d)`` becomes ``* (1/sqrt(d))``)::

    q [B,H,Sq,D]   k [B,Hkv,Sk,D]
      |              |
      |          transpose(2,3)
      +---- matmul --+          scores [B,H,Sq,Sk]   (written + read: 2·B·H·Sq·Sk·4 bytes)
              |
          mul(scale)            (or q * scale before the matmul, or no scale)
              |
          add(mask)             mask broadcastable to [B,H,Sq,Sk] (optional row)
              |
          softmax(dim=3)
              |
            matmul ---- v [B,Hkv,Sk,D]
              |
            out [B,H,Sq,D]   ==>   opfuse.attention(q, k, v, mask, scale, is_causal)

SDPA spelling: one ``aten.scaled_dot_product_attention`` node; it is re-targeted to
``opfuse.attention`` (Triton flash kernel on GPU) with no traffic saving claimed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..cost.model import Cost, fused_cost
from ..graph.meta import concrete
from .common import check_float, first_problem, shape, val
from .engine import IGNORE, Pattern

_SCALE = 0.125  # any value: the row binds the model's own scale (literal policy "scale")
_FILL = -1e30   # any value: bound ("fill") and checked to be a mask value (≤ -1e30)


def _qkv_example(mask: bool = True):
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    return (q, k, v, torch.randn(2, 1, 4, 4)) if mask else (q, k, v)


def eager_scaled_mask(q, k, v, mask):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * _SCALE + mask, dim=-1), v)


def eager_scaled(q, k, v):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * _SCALE, dim=-1), v)


def eager_qscaled_mask(q, k, v, mask):
    return torch.matmul(torch.softmax(torch.matmul(q * _SCALE, k.transpose(-2, -1)) + mask, dim=-1), v)


def eager_qscaled(q, k, v):
    return torch.matmul(torch.softmax(torch.matmul(q * _SCALE, k.transpose(-2, -1)), dim=-1), v)


def eager_unscaled(q, k, v):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)), dim=-1), v)


def eager_unscaled_mask(q, k, v, mask):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) + mask, dim=-1), v)


def eager_scaled_where(q, k, v, mask):
    s = torch.matmul(q, k.transpose(-2, -1)) * _SCALE
    return torch.matmul(torch.softmax(torch.where(mask, s, _FILL), dim=-1), v)


def eager_qscaled_where(q, k, v, mask):
    s = torch.matmul(q * _SCALE, k.transpose(-2, -1))
    return torch.matmul(torch.softmax(torch.where(mask, s, _FILL), dim=-1), v)


def eager_unscaled_where(q, k, v, mask):
    s = torch.matmul(q, k.transpose(-2, -1))
    return torch.matmul(torch.softmax(torch.where(mask, s, _FILL), dim=-1), v)


def eager_scaled_bias(q, k, v, bias, mask):
    """Two additive terms: a position bias then the padding/causal mask (T5: the relative
    position bias, then the extended mask; its scale is 1.0)."""
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * _SCALE + bias + mask, dim=-1), v)


def eager_unscaled_bias(q, k, v, bias, mask):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) + bias + mask, dim=-1), v)


def _bias_example():
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    return q, k, v, torch.randn(1, 2, 4, 4), torch.randn(2, 1, 4, 4)


_BETA = 1.0  # any value: bound ("beta") by the 3-D row


def bmm_alibi(q, k, v, bias, mask):
    """Bloom's ALiBi attention on 3-D [B·H, S, D] tensors::

        scores = bias.baddbmm(q, kᵀ, beta=β, alpha=scale)      # bias [B·H, 1, Sk]: ALiBi slopes · position
        probs  = softmax(scores.view(B, H, Sq, Sk) + mask)      # mask [B, 1, Sq, Sk]
        out    = bmm(probs.view(B·H, Sq, Sk), v)               # [B·H, Sq, D]

    The kernel runs it 4-D: q, k, v and the bias unflattened to [B, H, …] (views), the
    additive mask β·bias + mask (Press et al. 2022, "ALiBi": the bias is added to the
    scores before the softmax)."""
    scores = torch.baddbmm(bias, q, k.transpose(-1, -2), beta=_BETA, alpha=_SCALE)
    probs = torch.softmax(scores.view(2, 2, 4, 4) + mask, dim=-1)
    return torch.bmm(probs.view(4, 4, 4), v)


def bmm_kscaled_fill(q, k, v, mask):
    """DeBERTa-v2 on 3-D [B·H, S, D]: Kᵀ scaled (its ``/ sqrt(tensor(D)·factor)``, a
    constant after canonicalisation), ``masked_fill(~keep, finfo.min)`` on the 4-D view."""
    scores = torch.bmm(q, k.transpose(-1, -2) * _SCALE)
    probs = torch.softmax(scores.view(2, 2, 4, 4).masked_fill(~mask, _FILL), dim=-1)
    return torch.bmm(probs.view(4, 4, 4), v)


def bmm_kscaled_bias_fill(q, k, v, bias, mask):
    """DeBERTa-v2 with relative attention: the disentangled c2p / p2c bias [B·H, Sq, Sk]
    added to the scores before the view."""
    scores = torch.bmm(q, k.transpose(-1, -2) * _SCALE) + bias
    probs = torch.softmax(scores.view(2, 2, 4, 4).masked_fill(~mask, _FILL), dim=-1)
    return torch.bmm(probs.view(4, 4, 4), v)


def _bmm_fill_example():
    q, k, v = torch.randn(4, 4, 8), torch.randn(4, 4, 8), torch.randn(4, 4, 8)
    return q, k, v, torch.ones(2, 1, 4, 4, dtype=torch.bool)


def _bmm_bias_fill_example():
    q, k, v, mask = _bmm_fill_example()
    return q, k, v, torch.randn(4, 4, 4), mask


def _bmm_example():
    q, k, v = torch.randn(4, 4, 8), torch.randn(4, 4, 8), torch.randn(4, 4, 8)
    return q, k, v, torch.randn(4, 1, 4), torch.randn(2, 1, 4, 4)


def _bool_mask_example():
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    return q, k, v, torch.ones(4, 4, dtype=torch.bool).tril()


def sdpa_mask(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=_SCALE)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=_SCALE)


def _repeat_kv(x):
    """HF ``repeat_kv`` (Llama/Mistral GQA): [B, Hkv, S, D] -> [B, Hkv·n_rep, S, D] by
    expand + reshape (the reshape copies); the fused kernel maps query heads to K/V heads
    instead (Ainslie et al. 2023, "GQA")."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)


def _gqa(fn, mask: bool):
    if mask:
        def gqa_mask(q, k, v, mask):
            return fn(q, _repeat_kv(k), _repeat_kv(v), mask)
        return gqa_mask

    def gqa(q, k, v):
        return fn(q, _repeat_kv(k), _repeat_kv(v))
    return gqa


def _gqa_example(mask: bool = True):
    q, k, v = torch.randn(2, 4, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    return (q, k, v, torch.randn(2, 1, 4, 4)) if mask else (q, k, v)


def _finite_mask(node) -> bool:
    """True when ``node`` is ``where(cond, a, b)`` with ``a``/``b`` finite constants or
    ``zeros``/``full`` of a finite value, so the mask can hold no -inf."""
    def finite(a) -> bool:
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return math.isfinite(a)
        if getattr(a, "op", None) == "call_function" and a.target is torch.ops.aten.zeros.default:
            return True
        if getattr(a, "op", None) == "call_function" and a.target is torch.ops.aten.full.default:
            return finite(a.args[1])
        return False
    aten = torch.ops.aten
    while getattr(node, "op", None) == "call_function" and node.target in (aten.expand.default, aten.slice.Tensor,
                                                                         aten.unsqueeze.default, aten.view.default):
        node = node.args[0]
    if getattr(node, "op", None) != "call_function" or node.target not in (
            aten.where.ScalarOther, aten.where.Scalar, aten.where.ScalarSelf, aten.where.self):
        return False
    return all(finite(a) for a in node.args[1:3])


def _bmm_shapes(match) -> tuple[dict, str | None]:
    """A 3-D row's inputs read as the kernel's 4-D tensors: q, k, v [B·H, S, D] ->
    [B, H, S, D] with H from the region's scores view [B, H, Sq, Sk]; the bias
    [B·H or 1, 1 or Sq, Sk] -> [B or 1, H or 1, 1 or Sq, Sk]. Sets ``params["heads"]``."""
    views = [shape(n) for n in match.region if n.target in (torch.ops.aten.view.default,
                                                           torch.ops.aten._unsafe_view.default,
                                                           torch.ops.aten.reshape.default)]
    four = next((sv for sv in views if sv is not None and len(sv) == 4), None)
    q3, k3, v3 = (shape(match.inputs[n]) for n in ("q", "k", "v"))
    b3 = shape(match.inputs["bias"]) if "bias" in match.inputs else (1, 1, 1)
    if four is None or not (q3 and k3 and v3 and b3) or not (len(q3) == len(k3) == len(v3) == 3):
        return {}, f"3-D attention: q/k/v {q3}, {k3}, {v3} are not [B·H, S, D] beside a [B, H, Sq, Sk] view"
    batch, heads = four[0], four[1]
    if not isinstance(heads, int):
        return {}, f"3-D attention: the head count {heads} is not a constant"
    if q3[0] != batch * heads:
        return {}, f"3-D attention: q's leading dim {q3[0]} is not batch {batch} × heads {heads}"
    if len(b3) != 3 or b3[0] not in (1, q3[0]):
        return {}, (f"bias {match.inputs['bias'].name} has shape {list(b3)}; the kernel takes [B·H or 1, "
                    f"1 or Sq, Sk] (B·H = {q3[0]})")
    match.params["heads"] = heads
    match.params["bias_per_head"] = b3[0] != 1
    out = {n: (batch, heads, *shape(match.inputs[n])[1:]) for n in ("q", "k", "v")}
    if "bias" in match.inputs:
        out["bias"] = ((batch, heads) if b3[0] != 1 else (1, 1)) + tuple(b3[1:])
    return out, None


def check(match) -> str | None:
    """Legality on real shapes: rank-4 Q/K/V (3-D [B·H, S, D] rows read as 4-D), matching
    head dims, grouped K/V heads dividing Q heads, every additive mask / bias broadcastable
    to [B,H,Sq,Sk], the scale a real number."""
    if match.pattern.variant.startswith("bmm"):
        shapes, problem = _bmm_shapes(match)
        if problem:
            return problem
    else:
        shapes = {n: shape(match.inputs[n]) for n in ("q", "k", "v", "bias") if n in match.inputs}
    q, k, v = (shapes[n] for n in ("q", "k", "v"))
    names = {n: match.inputs[n].name for n in ("q", "k", "v")}
    if not (q and k and v and len(q) == len(k) == len(v) == 4):
        return (f"Q/K/V must be 4-D [B, H, S, D]; got q {names['q']} {q}, k {names['k']} {k}, "
                f"v {names['v']} {v}")
    # [B, H, S, D]: name the dim that disagrees in the model's terms
    for what, a, b in (("head dim D", ("q", q[3]), ("k", k[3])), ("key/value sequence Sk", ("k", k[2]), ("v", v[2])),
                       ("key/value heads", ("k", k[1]), ("v", v[1])), ("batch B", ("q", q[0]), ("k", k[0]))):
        if a[1] != b[1]:
            return (f"Q/K/V disagree in {what}: {a[0]} {names[a[0]]} has {a[1]}, {b[0]} {names[b[0]]} has {b[1]} "
                    f"(q {list(q)}, k {list(k)}, v {list(v)} as [B, H, S, D])")
    if q[1] % k[1]:
        return f"key/value heads ({k[1]}, {names['k']}) do not divide query heads ({q[1]}, {names['q']})"
    dead = False
    for name in ("bias", "mask"):
        mask = match.inputs.get(name)
        if mask is None:
            continue
        m = shapes.get(name) or shape(mask)
        target = (q[0], q[1], q[2], k[2])
        if m is None or len(m) > 4 or any(a not in (1, b) for a, b in zip(m[::-1], target[::-1])):
            return f"{name} {mask.name} has shape {m}, not broadcastable to [B, H, Sq, Sk] = {list(target)}"
        if len(m) < 2:  # ATen SDPA (the CPU kernel) raises on a 1-D mask
            return f"{name} {mask.name} is 1-D {list(m)}; the kernel needs a mask of rank 2 to 4"
        mv = val(mask)
        if mv.dtype not in (torch.bool, val(match.inputs['q']).dtype, torch.float32):
            return f"{name} {mask.name} dtype {mv.dtype} is neither bool nor the query dtype"
        if not match.pattern.variant.startswith("sdpa") and "fill" not in match.literals \
                and not mv.dtype.is_floating_point:
            # eager spellings ADD the mask: a bool mask adds 0/1, the kernel would drop positions
            # (an SDPA source, grouped-query rows included, reads a bool mask as keep/drop, as the kernel)
            return f"{name} {mask.name} is {mv.dtype} but added to the scores (+0/+1), not a keep/drop mask"
        # eager softmax of a fully masked (-inf) row is NaN; the SDPA kernel returns 0 there.
        # Masks built by where(cond, 0, finite fill) (HF's finfo.min masks) never hold -inf. A
        # boolean mask reaches the kernel only from an SDPA source (checked above), which reads
        # it exactly as the kernel does: nothing to restore (and isneginf of a bool is False)
        unsure = mv.dtype != torch.bool and not match.pattern.retarget and not _finite_mask(mask)
        dead = dead or unsure
        if name == "bias":
            match.params["bias_may_be_inf"] = unsure
    if "mask" in match.inputs:
        match.params["dead_rows_nan"] = dead
    beta = match.literals.get("beta", 1.0)
    if not isinstance(beta, (int, float)) or isinstance(beta, bool):
        return f"baddbmm beta {beta!r} is not a constant number"
    match.params["beta"] = float(beta)
    if match.literals.get("dropout_p", 0.0) not in (0, 0.0):
        return f"dropout_p={match.literals['dropout_p']} (training mode) cannot be fused for inference"
    scale = match.literals.get("scale", 1.0)
    if scale is None:  # SDPA default: 1/sqrt(D)
        scale = 1.0 / math.sqrt(q[-1])
    if not isinstance(scale, (int, float)):
        return f"scale {scale!r} is not a constant number"
    match.params["scale"] = float(scale)
    if "fill" in match.literals:  # where(mask, scores, fill): a boolean keep-mask
        fill = match.literals["fill"]
        qdtype = val(match.inputs["q"]).dtype
        if val(mask).dtype != torch.bool:
            return f"where-mask {mask.name} is {val(mask).dtype}, expected bool"
        if not isinstance(fill, (int, float)) or fill > -1e30:
            return f"where fill value {fill!r} is not a mask value (≤ -1e30); it would change the result"
        if qdtype != torch.float32:
            return (f"where-masked attention in {qdtype}: a fully masked row would differ from eager "
                    f"(fill {fill} is not representable); left unfused")
        match.params["fill"] = float(fill)
        match.params["dead_rows_nan"] = math.isinf(fill) or match.params.get("bias_may_be_inf", False)
    match.params["is_causal"] = bool(match.literals.get("is_causal", False))
    if match.literals.get("enable_gqa", False) is False and q[1] != k[1] and k[1] != 1 \
            and match.pattern.variant.startswith("sdpa") and not match.pattern.variant.endswith("_gqa"):
        # one K/V head broadcasts over the query heads (multi-query attention: Falcon), which is
        # grouped-query attention with one group; other counts make SDPA itself raise
        return f"SDPA with {q[1]} query heads and {k[1]} key heads but enable_gqa=False"
    # an eager spelling without a mask: softmax(q·kᵀ)·v of a query row holding a NaN is a NaN
    # row, where ATen's CPU flash kernel without a mask returns 0 (torch 2.13; with a mask it
    # gives NaN); an SDPA source computes what the kernel does
    match.params["nan_query_rows"] = not match.pattern.variant.startswith("sdpa") and \
        "mask" not in match.inputs and "bias" not in match.inputs and "fill" not in match.literals
    return check_float(match, "q", "k", "v")


def build(graph, inputs, literals, params):
    aten = torch.ops.aten
    op = torch.ops.opfuse.attention.default
    mask = inputs.get("mask")
    q, k, v, bias = inputs["q"], inputs["k"], inputs["v"], inputs.get("bias")
    heads = params.get("heads")
    if heads is not None:  # 3-D [B·H, S, D] row: 4-D views for the kernel
        q, k, v = (graph.call_function(aten.unflatten.int, (t, 0, [-1, heads])) for t in (q, k, v))
        if params.get("bias_per_head"):
            bias = graph.call_function(aten.unflatten.int, (bias, 0, [-1, heads]))
        if params.get("beta", 1.0) != 1.0:
            bias = graph.call_function(aten.mul.Tensor, (bias, params["beta"]))
    if "fill" in params:
        # where(keep, scores, fill) -> additive float32 mask 0 / fill over the (small, broadcast)
        # mask shape: identical to eager, fully masked rows included (finfo.min: the mean of V;
        # -inf: NaN, restored below), which a boolean SDPA mask would not give (it returns 0)
        mask = graph.call_function(aten.where.Scalar, (mask, 0.0, params["fill"]))
    if bias is not None:  # one additive mask: bias + mask, at their broadcast shape
        mask = graph.call_function(aten.add.Tensor, (bias, mask))
    out = graph.call_function(op, (q, k, v, mask, params["scale"], params["is_causal"]))
    if params.get("nan_query_rows"):  # keep eager's NaN for query rows holding a NaN (check)
        bad = graph.call_function(aten.any.dim, (graph.call_function(aten.isnan.default, (q,)), -1, True))
        out = graph.call_function(aten.masked_fill.Scalar, (out, bad, float("nan")))
    if params.get("dead_rows_nan"):  # keep eager's NaN for query rows whose mask is all -inf
        dead = graph.call_function(aten.all.dim, (graph.call_function(aten.isneginf.default, (mask,)), -1, True))
        out = graph.call_function(aten.masked_fill.Scalar, (out, dead, float("nan")))
    if heads is not None:
        out = graph.call_function(aten.flatten.using_ints, (out, 0, 1))  # [B·H, Sq, D], as the bmm
    return [out]


def bias_mask_cost(match, device) -> Cost:
    """Fused traffic of a row with two additive terms: external inputs once, the output
    once, plus the bias + mask sum the kernel reads, written and read once at their
    broadcast shape (up to [B, H, Sq, Sk], float32: 4 bytes each)."""
    base = fused_cost(match.region, list(match.outputs))
    q, k = shape(match.inputs["q"]), shape(match.inputs["k"])
    heads = match.params.get("heads")
    if heads:  # 3-D row: [B·H, Sq, Sk]
        sizes = (q[0], q[1], k[1])
    else:  # the broadcast of bias and mask, dim by dim (4-D)
        b, m = (tuple(concrete(d) for d in shape(match.inputs[n])) for n in ("bias", "mask"))
        b, m = (1,) * (4 - len(b)) + b, (1,) * (4 - len(m)) + m
        sizes = tuple(max(x, y) for x, y in zip(b, m))
    elems = math.prod(concrete(d) for d in sizes)
    return base + Cost(0, 4 * elems, 4 * elems)


_SDPA_LITERALS = {"scale": "scale", "is_causal": "is_causal", "dropout_p": "dropout_p",
                  "enable_gqa": "enable_gqa"}
_EAGER_LITERALS = {"other": "scale", "where.other": "fill"}
_BMM_LITERALS = {"baddbmm.alpha": "scale", "baddbmm.beta": "beta"}
_BMM_FILL_LITERALS = {"mul.other": "scale", "masked_fill.value": "fill"}

_ROWS = [
        ("eager_scaled_mask", eager_scaled_mask, True, _EAGER_LITERALS, False),
        ("eager_scaled", eager_scaled, False, _EAGER_LITERALS, False),
        ("eager_qscaled_mask", eager_qscaled_mask, True, _EAGER_LITERALS, False),
        ("eager_qscaled", eager_qscaled, False, _EAGER_LITERALS, False),
        ("eager_unscaled_mask", eager_unscaled_mask, True, _EAGER_LITERALS, False),
        ("eager_unscaled", eager_unscaled, False, _EAGER_LITERALS, False),
        ("eager_scaled_where", eager_scaled_where, "bool", _EAGER_LITERALS, False),
        ("eager_qscaled_where", eager_qscaled_where, "bool", _EAGER_LITERALS, False),
        ("eager_unscaled_where", eager_unscaled_where, "bool", _EAGER_LITERALS, False),
        ("eager_scaled_bias", eager_scaled_bias, "bias", _EAGER_LITERALS, False),
        ("eager_unscaled_bias", eager_unscaled_bias, "bias", _EAGER_LITERALS, False),
        ("bmm_alibi", bmm_alibi, "bmm", _BMM_LITERALS, False),
        ("bmm_kscaled_fill", bmm_kscaled_fill, "bmm_fill", _BMM_FILL_LITERALS, False),
        ("bmm_kscaled_bias_fill", bmm_kscaled_bias_fill, "bmm_bias_fill", _BMM_FILL_LITERALS, False),
        ("sdpa_mask", sdpa_mask, True, _SDPA_LITERALS, True),
        ("sdpa", sdpa, False, _SDPA_LITERALS, True),
]

_EXAMPLES = {"bool": _bool_mask_example, "bias": _bias_example, "bmm": _bmm_example, "bmm_fill": _bmm_fill_example,
             "bmm_bias_fill": _bmm_bias_fill_example}

PATTERNS = [
    Pattern("attention", variant, fn, _EXAMPLES.get(mask, lambda m=mask: _qkv_example(m)),
            build, check, literals=literals, retarget=retarget,
            fused_cost=bias_mask_cost if mask in ("bias", "bmm", "bmm_bias_fill") else None)
    for variant, fn, mask, literals, retarget in _ROWS
] + [  # grouped-query rows: K/V repeated by expand+reshape in the source, mapped by index in the kernel
    Pattern("attention", variant + "_gqa", _gqa(fn, bool(mask)), lambda m=mask: _gqa_example(m), build, check,
            literals=literals, retarget=False)
    for variant, fn, mask, literals, retarget in _ROWS if mask in (True, False)
]
