"""Hugging Face architectures built from tiny configs: the architecture tier's table.

Each row builds a real ``transformers`` model from its config class (its default settings,
``use_cache`` included, with only the sizes made small) and the inputs people pass it:
token ids with an ``attention_mask`` (one row padded: on the right for encoders, on the
left for decoders), ``pixel_values`` for vision models, log-mel ``input_features`` for
Whisper's encoder. The CI tier (``tests/cpu/test_zoo.py``) optimizes every row with each
attention implementation the class has and checks values against the float64 model and
the fused count per pattern against ``tests/golden/zoo.json``; ``benchmarks/zoo_table.py``
renders the README's per-architecture table from the same rows.

No weights are downloaded: every model is randomly initialised from its config (seed 0).
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

VOCAB = 500
#: sizes shared by most rows: 2 layers, hidden 64, 4 heads of 16, MLP 128, 256 positions
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
             max_position_embeddings=256)
DECODER = dict(SMALL, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Arch:
    """One architecture of the tier.

    name:   short name (``"llama"``); ``kind``: ``"encoder"`` (ids + right-padded mask),
            ``"decoder"`` (ids + left-padded mask), ``"image"`` (pixel_values
            [B, 3, size, size] float32), ``"audio"`` (input_features [B, mels, frames]).
    model:  ``transformers`` model class name (or ``module.path.Class`` under ``transformers``
            for classes it does not export, e.g. Whisper's encoder); ``config``: its config
            class name and kwargs.
    blocks: attention and MLP blocks the model has (``{"attention": 2, "mlp": 2}``): the
            denominator of the README's fused / blocks columns.
    notes:  why a block stays unfused where the plan records no near miss.
    attns:  attention implementations tested (``"sdpa"`` only where the class supports it).
    sizes:  (batch, seq) pairs: the example the plan is made at, then a second shape
            (for images: seq is the image side in pixels; audio: the frames are fixed by
            the config, seq is ignored).
    """

    name: str
    kind: str
    model: str
    config: str
    kwargs: dict
    attns: tuple[str, ...] = ("eager", "sdpa")
    sizes: tuple[tuple[int, int], ...] = ((2, 12), (3, 7))
    model_kwargs: dict | None = None
    blocks: dict | None = None
    notes: tuple[str, ...] = ()   # known gaps with no near miss to show (the README's table)

    @property
    def block_counts(self) -> dict[str, int]:
        return self.blocks or {"attention": 2, "mlp": 2}

    def build(self, attn: str = "eager") -> torch.nn.Module:
        """The model in eval mode, seed 0, ``attn_implementation=attn``."""
        import importlib

        import transformers as T
        torch.manual_seed(0)
        cfg = getattr(T, self.config)(**self.kwargs)
        module, _, cls = self.model.rpartition(".")
        owner = importlib.import_module(f"transformers.{module}") if module else T
        model = getattr(owner, cls)._from_config(cfg, attn_implementation=attn, **(self.model_kwargs or {}))
        return model.eval()

    def inputs(self, model: torch.nn.Module, batch: int, seq: int, seed: int = 0) -> tuple[tuple, dict]:
        """(args, kwargs) for one call: see ``kind``. Token ids avoid 0..2 (pad/bos/eos)."""
        g = torch.Generator().manual_seed(seed)
        cfg = model.config
        if self.kind == "image":
            vision = getattr(cfg, "vision_config", cfg)
            return (torch.randn(batch, vision.num_channels, seq, seq, generator=g),), {}
        if self.kind == "audio":
            frames = 2 * cfg.max_source_positions
            return (torch.randn(batch, cfg.num_mel_bins, frames, generator=g),), {}
        vocab = getattr(getattr(cfg, "text_config", cfg), "vocab_size", VOCAB)
        ids = torch.randint(3, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        if batch > 1:
            pad = max(1, seq // 4)
            if self.kind == "decoder":
                mask[0, :pad] = 0   # left padding, as generate() batches prompts
            else:
                mask[0, seq - pad:] = 0
        return (ids,), {"attention_mask": mask}


def _row(name, kind, model, config, attns=("eager", "sdpa"), sizes=None, model_kwargs=None, blocks=None, notes=(),
         **kwargs) -> Arch:
    return Arch(name, kind, model, config, kwargs, tuple(attns), sizes or Arch.sizes, model_kwargs, blocks,
                tuple(notes))


_QUICK_GELU = ("MLP: quick GELU x·σ(1.702x) between fc1 and fc2 — no epilogue form for it (the GELU epilogue "
               "and FFN kernels take erf / tanh GELU)",)


_IMG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
            patch_size=8)

ARCHITECTURES: tuple[Arch, ...] = (
    # encoders
    _row("bert", "encoder", "BertModel", "BertConfig", **SMALL),
    _row("distilbert", "encoder", "DistilBertModel", "DistilBertConfig", dim=64, hidden_dim=128, n_layers=2,
         n_heads=4, vocab_size=VOCAB, max_position_embeddings=256),
    _row("roberta", "encoder", "RobertaModel", "RobertaConfig", **dict(SMALL, pad_token_id=1)),
    _row("albert", "encoder", "AlbertModel", "AlbertConfig", embedding_size=32, **SMALL),
    _row("electra", "encoder", "ElectraModel", "ElectraConfig", embedding_size=32, **SMALL),
    _row("deberta-v2", "encoder", "DebertaV2Model", "DebertaV2Config", attns=("eager",), **SMALL),
    _row("deberta-v3", "encoder", "DebertaV2Model", "DebertaV2Config", attns=("eager",), relative_attention=True,
         pos_att_type=["p2c", "c2p"], position_buckets=32, max_relative_positions=-1, norm_rel_ebd="layer_norm",
         share_att_key=True, **SMALL),
    _row("modernbert", "encoder", "ModernBertModel", "ModernBertConfig",
         **dict(SMALL, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0)),
    _row("clip-text", "encoder", "CLIPTextModel", "CLIPTextConfig", notes=_QUICK_GELU, hidden_size=64, intermediate_size=128,
         num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=77),
    _row("t5-encoder", "encoder", "T5EncoderModel", "T5Config", d_model=64, d_ff=128, num_layers=2, num_heads=4,
         d_kv=16, vocab_size=VOCAB, feed_forward_proj="gated-gelu"),
    _row("bart", "encoder", "BartModel", "BartConfig", blocks={"attention": 6, "mlp": 4}, d_model=64, encoder_layers=2, decoder_layers=2,
         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
         vocab_size=VOCAB, max_position_embeddings=256),
    _row("whisper-encoder", "audio", "models.whisper.modeling_whisper.WhisperEncoder", "WhisperConfig", d_model=64, encoder_layers=2,
         decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
         decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=16, vocab_size=VOCAB),
    # decoders (default configs: use_cache=True)
    _row("gpt2", "decoder", "GPT2Model", "GPT2Config", n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
         n_positions=256),
    _row("opt", "decoder", "OPTModel", "OPTConfig",
         notes=("MLP: ReLU between fc1 and fc2 — no ReLU epilogue form (the epilogue kernels take GELU)",),
         hidden_size=64, ffn_dim=128, num_hidden_layers=2,
         num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=256, word_embed_proj_dim=64),
    _row("gpt-neox", "decoder", "GPTNeoXModel", "GPTNeoXConfig", rotary_pct=0.5, **SMALL),
    _row("gptj", "decoder", "GPTJModel", "GPTJConfig", n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
         vocab_size=VOCAB, n_positions=256),
    _row("bloom", "decoder", "BloomModel", "BloomConfig", attns=("eager",), hidden_size=64, n_layer=2, n_head=4,
         vocab_size=VOCAB),
    _row("falcon", "decoder", "FalconModel", "FalconConfig", hidden_size=64, num_hidden_layers=2,
         num_attention_heads=4, vocab_size=VOCAB),
    _row("llama", "decoder", "LlamaModel", "LlamaConfig", **DECODER),
    _row("qwen2", "decoder", "Qwen2Model", "Qwen2Config", **DECODER),
    _row("mistral", "decoder", "MistralModel", "MistralConfig", sizes=((2, 12), (3, 20)),
         **dict(DECODER, sliding_window=8)),
    _row("gemma", "decoder", "GemmaModel", "GemmaConfig", head_dim=16, **DECODER),
    _row("phi3", "decoder", "Phi3Model", "Phi3Config", **DECODER),
    # vision
    _row("vit", "image", "ViTModel", "ViTConfig", sizes=((2, 32), (1, 32)), model_kwargs={"add_pooling_layer": False},
         **_IMG),
    _row("clip-vision", "image", "CLIPVisionModel", "CLIPVisionConfig", notes=_QUICK_GELU, sizes=((2, 32), (1, 32)), **_IMG),
    _row("dinov2", "image", "Dinov2Model", "Dinov2Config", sizes=((2, 32), (1, 48)), **_IMG),
    _row("swin", "image", "SwinModel", "SwinConfig", sizes=((2, 32), (1, 32)), blocks={"attention": 4, "mlp": 4}, embed_dim=16, depths=[2, 2],
         num_heads=[2, 4], window_size=4, image_size=32, patch_size=2),
)

BY_NAME: dict[str, Arch] = {a.name: a for a in ARCHITECTURES}


def cases() -> list[tuple[Arch, str]]:
    """Every (architecture, attention implementation) pair of the tier."""
    return [(a, attn) for a in ARCHITECTURES for attn in a.attns]


def first_output(out) -> torch.Tensor:
    """The main tensor of a model output: ``last_hidden_state`` or the first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    hidden = getattr(out, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    return out[0]

