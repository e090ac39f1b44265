"""The all-MiniLM-L6-v2 sentence encoder: a BERT encoder plus mean pooling, in plain PyTorch.

Reads top to bottom: the configuration, then the building blocks in the order a token
meets them (embeddings, self-attention, feed-forward, one layer, the stack of layers),
then `SentenceEncoder`, which pools token vectors into one unit-length vector per text.

Submodule attributes carry the names of the Hugging Face BERT checkpoint
(`encoder.layer.0.attention.self.query.weight`, `...output.LayerNorm.weight`, ...), so
its state dict loads with `strict=True` and no renaming table to keep in sync. That is
why some attributes are capitalised (`LayerNorm`) and one is called `self`.

There is no dropout anywhere: this module only ever runs inference, where dropout is the
identity, and leaving it out keeps the forward pass equal to what it computes.

No I/O, logging or device policy here: the loader decides where weights come from and
where the model runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias in PyTorch code
from torch import Tensor, nn


@dataclass(frozen=True)
class EncoderConfig:
    """Shape and numerics of a BERT encoder; everything needed to build `SentenceEncoder`."""

    # Rows of the token embedding table; must cover every id the tokenizer can emit.
    vocab_size: int
    # Width H of each token vector between layers, and so of the sentence embedding.
    hidden_size: int
    # Transformer layers stacked on the embeddings (6 for MiniLM-L6).
    num_layers: int
    # Attention heads per layer; each head attends over hidden_size // num_heads dimensions.
    num_heads: int
    # Width of the feed-forward block's inner layer (4 * hidden_size in BERT-style models).
    intermediate_size: int
    # Length of the learned position table: the hard upper bound on tokens per text.
    max_position_embeddings: int
    # Segment (sentence A/B) embeddings from pre-training; single texts always use segment 0,
    # but the table is part of the checkpoint and its row 0 is added to every token.
    type_vocab_size: int
    # LayerNorm epsilon; BERT uses 1e-12 and a different value would shift every output.
    layer_norm_eps: float
    # Id of [PAD]: its embedding row gets no gradient, which matters only when fine-tuning,
    # but keeping it makes this module the same as the one the checkpoint was trained as.
    pad_token_id: int

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "type_vocab_size": self.type_vocab_size,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocabulary")

    @classmethod
    def from_bert_config(cls, d: Mapping[str, object]) -> EncoderConfig:
        """Read a Hugging Face BERT `config.json` dict, refusing settings not implemented here.

        Every size is required rather than defaulted: a config that omits one is more likely
        a different model than one that relies on BERT's defaults.
        """
        # Each of these would make the checkpoint compute something other than what
        # `SentenceEncoder` computes, so loading it anyway would give wrong embeddings quietly.
        expected_settings: dict[str, object] = {
            "model_type": "bert",
            # Exact (erf) GELU; "gelu_new"/"gelu_fast" are tanh approximations.
            "hidden_act": "gelu",
            # Learned absolute positions; relative-position variants need other weights.
            "position_embedding_type": "absolute",
            # A decoder would need causal masking and cross-attention.
            "is_decoder": False,
            "add_cross_attention": False,
        }
        # What Hugging Face assumes when a key is absent; model_type has no default.
        absent_means = {
            "hidden_act": "gelu",
            "position_embedding_type": "absolute",
            "is_decoder": False,
            "add_cross_attention": False,
        }
        for key, expected in expected_settings.items():
            if key not in d and key not in absent_means:
                raise ValueError(f"missing {key!r}; expected {expected!r}")
            actual = d.get(key, absent_means.get(key))
            if actual != expected:
                raise ValueError(f"unsupported {key}={actual!r}; only {expected!r} is implemented")
        return cls(
            vocab_size=_read_int(d, "vocab_size"),
            hidden_size=_read_int(d, "hidden_size"),
            num_layers=_read_int(d, "num_hidden_layers"),
            num_heads=_read_int(d, "num_attention_heads"),
            intermediate_size=_read_int(d, "intermediate_size"),
            max_position_embeddings=_read_int(d, "max_position_embeddings"),
            type_vocab_size=_read_int(d, "type_vocab_size"),
            layer_norm_eps=_read_float(d, "layer_norm_eps"),
            pad_token_id=_read_int(d, "pad_token_id"),
        )


def _read_int(d: Mapping[str, object], key: str) -> int:
    value = d.get(key)
    # bool is an int subclass; `true` where a size belongs is a broken file, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    return value


def _read_float(d: Mapping[str, object], key: str) -> float:
    value = d.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{key!r} must be a number, got {value!r}")
    return float(value)


class Embeddings(nn.Module):
    """Token id -> vector: word + segment + position embeddings, then LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor) -> Tensor:
        seq_len = input_ids.shape[1]
        # Right padding means every row's real tokens start at position 0.
        positions = torch.arange(seq_len, device=input_ids.device)  # (T,)
        # Every text is a single segment A, so the segment vector is row 0 for all tokens.
        segment = self.token_type_embeddings.weight[0]  # (H,)
        # Same summation order as the reference, so rounding matches it too.
        x = self.word_embeddings(input_ids) + segment  # (B, T, H)
        x = x + self.position_embeddings(positions)  # (B, T, H)
        normed: Tensor = self.LayerNorm(x)
        return normed


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product attention in which no token attends to padding."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_size = config.hidden_size // config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor, attend_to: Tensor) -> Tensor:
        """`attend_to` is a bool (B, 1, 1, T) mask, True for real (non-padding) keys."""
        batch, seq_len, hidden = x.shape

        def split_heads(t: Tensor) -> Tensor:
            t = t.view(batch, seq_len, self.num_heads, self.head_size)  # (B, T, nh, hs)
            return t.transpose(1, 2)  # (B, nh, T, hs)

        q = split_heads(self.query(x))
        k = split_heads(self.key(x))
        v = split_heads(self.value(x))
        # The fused kernel scales by 1/sqrt(head_size) like BERT and picks a fast
        # implementation per device; a False in the mask is -inf before the softmax,
        # so padded keys get exactly zero weight and padding cannot change real tokens.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attend_to)  # (B, nh, T, hs)
        return y.transpose(1, 2).reshape(batch, seq_len, hidden)  # (B, T, H)


class ResidualOutput(nn.Module):
    """Project back to H, add the block's input, then LayerNorm (BERT is post-norm)."""

    def __init__(self, in_features: int, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        normed: Tensor = self.LayerNorm(self.dense(h) + residual)  # (B, T, H)
        return normed


class Attention(nn.Module):
    """Self-attention sublayer with its residual connection and LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        # Attribute named `self` because the checkpoint key is `attention.self.query.weight`.
        self.self = SelfAttention(config)
        self.output = ResidualOutput(config.hidden_size, config)

    def forward(self, x: Tensor, attend_to: Tensor) -> Tensor:
        attended: Tensor = self.output(self.self(x, attend_to), x)  # (B, T, H)
        return attended


class FeedForwardExpansion(nn.Module):
    """First half of the feed-forward block: widen each token to intermediate_size, then GELU."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        # Exact erf GELU, as the checkpoint was trained with; the tanh approximation moves
        # embedding components by up to ~4e-4 away from the reference.
        return F.gelu(self.dense(x), approximate="none")  # (B, T, I)


class EncoderLayer(nn.Module):
    """One transformer layer: attention sublayer, then feed-forward sublayer, each post-norm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        # The checkpoint splits the feed-forward block into `intermediate` (widen + GELU)
        # and `output` (narrow + residual + LayerNorm); the attributes follow it.
        self.intermediate = FeedForwardExpansion(config)
        self.output = ResidualOutput(config.intermediate_size, config)

    def forward(self, x: Tensor, attend_to: Tensor) -> Tensor:
        attended = self.attention(x, attend_to)  # (B, T, H)
        out: Tensor = self.output(self.intermediate(attended), attended)  # (B, T, H)
        return out


class Encoder(nn.Module):
    """The stack of layers; holds them in `layer` so keys read `encoder.layer.N...`."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))

    def forward(self, x: Tensor, attend_to: Tensor) -> Tensor:
        for layer in self.layer:
            x = layer(x, attend_to)  # (B, T, H)
        return x


class SentenceEncoder(nn.Module):
    """Token ids -> one L2-normalised embedding per text (BERT, then mean over real tokens)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        assert config.hidden_size % config.num_heads == 0, "heads must split hidden_size evenly"
        assert 0 <= config.pad_token_id < config.vocab_size, "pad id must be a vocabulary row"
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    @property
    def hidden_size(self) -> int:
        """Width H of the sentence embeddings this module returns."""
        return self.config.hidden_size

    @property
    def max_tokens(self) -> int | None:
        """Longest input, [CLS]/[SEP] included: the learned position table's length."""
        return self.config.max_position_embeddings

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """`input_ids` (B, T) int64 and `attention_mask` (B, T), 1 for real tokens -> (B, H).

        The embeddings are float32 whatever dtype the weights are in.
        """
        if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask "
                f"{tuple(attention_mask.shape)} must both be (batch, tokens)"
            )
        # Checked here because past the table's end an embedding lookup fails on CUDA
        # with a device-side assert that poisons the whole process.
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"{input_ids.shape[1]} tokens exceed max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        is_real = attention_mask.bool()  # (B, T)
        attend_to = is_real[:, None, None, :]  # (B, 1, 1, T), broadcast over heads and queries
        tokens = self.encoder(self.embeddings(input_ids), attend_to)  # (B, T, H)
        return mean_pool_and_normalise(tokens, is_real)


def mean_pool_and_normalise(tokens: Tensor, is_real: Tensor) -> Tensor:
    """Average each text's real token vectors, then scale to unit length: (B, T, H) -> (B, H).

    Padded positions hold finite but meaningless vectors (their queries still attend to
    real keys), so they are weighted out here rather than trusted to be zero.
    The result is always float32.
    """
    # A bfloat16 model would otherwise sum up to hundreds of token vectors with 8 bits of
    # mantissa; for a float32 model `.float()` returns the same tensor, so nothing changes.
    tokens = tokens.float()  # (B, T, H)
    weights = is_real.unsqueeze(-1).to(tokens.dtype)  # (B, T, 1)
    summed = (tokens * weights).sum(dim=1)  # (B, H)
    # The clamp only guards an all-padding row, which the tokenizer never produces
    # ([CLS] and [SEP] are always there); it mirrors the reference pipeline's guard.
    counts = weights.sum(dim=1).clamp(min=1e-9)  # (B, 1)
    return F.normalize(summed / counts, p=2, dim=1)  # (B, H)
