"""sentence-transformers as a client: one call puts an optimized transformer into a
``SentenceTransformer``, whose ``encode()`` then runs one dynamic opfuse plan for every
batch and padded length it meets.

    from sentence_transformers import SentenceTransformer
    import opfuse.sentence
    st = SentenceTransformer(path, device="cpu")
    opfuse.sentence.optimize(st)          # st.encode(...) now runs fused
"""

from __future__ import annotations

import torch

def _examples() -> list[str]:
    """Default example batch: 32 sentences (``encode``'s default batch size) of
    :data:`opfuse.models.SENTENCES`: a typical size to decide the plan at."""
    from .models import SENTENCES
    return (SENTENCES * 4)[:32]


class SentenceTransformerError(ValueError):
    """The object is not a SentenceTransformer whose first module wraps a Hugging Face model."""


def _transformer(st):
    first = st[0] if len(st) else None
    model = getattr(first, "model", None) if first is not None else None
    if model is None:
        model = getattr(first, "auto_model", None)
    if not isinstance(model, torch.nn.Module):
        raise SentenceTransformerError(f"opfuse.sentence: {type(st).__name__}'s first module "
                                       f"({type(first).__name__}) holds no Hugging Face model (.model / .auto_model)")
    return first, model


def example_kwargs(st, sentences: list[str]) -> dict:
    """The keyword arguments ``st``'s transformer module passes its model for ``sentences``
    (recorded from one real ``encode`` call: token ids, attention mask, token types,
    ``return_dict``...)."""
    first, model = _transformer(st)
    seen: dict = {}
    original = model.forward

    def record(*args, **kwargs):
        if args:
            raise SentenceTransformerError("opfuse.sentence: the transformer module called its model with positional "
                                           "arguments; optimize it with opfuse.optimize directly")
        seen.update(kwargs)
        return original(**kwargs)
    model.forward = record
    try:
        st.encode(sentences, batch_size=len(sentences), convert_to_tensor=True)
    finally:
        del model.forward  # the instance attribute goes; the class's forward is back
    return seen


def optimize(st, sentences: list[str] | None = None, dynamic: bool = True, **options):
    """Replace the Hugging Face model inside ``st`` (a ``sentence_transformers.SentenceTransformer``)
    by ``opfuse.optimize`` of it, planned on what ``encode(sentences)`` feeds it, with
    dynamic batch and sequence dims by default: every later ``st.encode`` (any batch size,
    any padded length up to the model's positions) runs the same fused plan. Embeddings
    stay equal to the unoptimized model's within float32 round-off (tested: cosine ≥ 0.99999).

    Args:
        st: the SentenceTransformer (changed in place: its first module's model is replaced).
        sentences: example sentences (default: 32 short sentences, :func:`_examples`); the
            plan is decided (cost, time gate, GEMM backends) at their batch and padded length.
        dynamic: one plan for every shape (:func:`opfuse.optimize`'s ``dynamic``).
        options: further :func:`opfuse.optimize` options (theta, gemm, decide...).
    Returns:
        the :class:`opfuse.FusedModule` now inside ``st`` (``.report``; its original model
        stays reachable as the FusedModule's source). Raises:
        SentenceTransformerError: ``st`` has no Hugging Face model in its first module.
    """
    import opfuse
    first, model = _transformer(st)
    kwargs = example_kwargs(st, list(sentences or _examples()))
    constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    if constants != {"return_dict": True} and constants:
        raise SentenceTransformerError(f"opfuse.sentence: the transformer module passes {constants}; only "
                                       "return_dict=True is understood (optimize the model with opfuse.optimize)")
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    fused = opfuse.optimize(model, (), example_kwargs=tensors, dynamic=dynamic,
                            name=options.pop("name", type(model).__name__), **options)
    adapter = _ReturnDict(fused, model)
    if hasattr(first, "model") and first.model is model:
        first.model = adapter
    else:
        first.auto_model = adapter
    return fused


class _ReturnDict(torch.nn.Module):
    """What sentence-transformers calls instead of its model: the fused module, called
    without ``return_dict=True`` (the Hugging Face default, so the captured program returns
    the same ModelOutput; torch.export cannot take a constant inside a forward's
    ``**kwargs`` together with dynamic shapes). ``config`` is the model's."""

    def __init__(self, fused, model):
        super().__init__()
        self.fused = fused
        self.config = getattr(model, "config", None)

    def forward(self, **kwargs):
        if kwargs.pop("return_dict", True) is not True:
            raise SentenceTransformerError("opfuse.sentence: return_dict=False is not supported")
        return self.fused(**kwargs)
