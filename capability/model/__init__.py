"""The text classifiers behind the capability servers: sentence encoders, heads, tokenizer.

Encoders: all-MiniLM-L6-v2 in plain PyTorch (`SentenceEncoder`) and the static average of
its word vectors (`StaticEmbeddingEncoder`). Heads: zero-shot prototypes (`ZeroShotHead`)
and linear (`LinearHead`). Nothing here reads files; the loaders live in `capability.bundle`
(model bundles, and `minilm.py` for a sentence-transformers folder).
"""

from capability.model.classifier import (
    DEFAULT_GRAPH,
    GRAPHS,
    PRECISION_DTYPES,
    ClassifyBatchResult,
    TextClassifier,
    TextEncoder,
    embed_label_prototypes,
)
from capability.model.encoder import EncoderConfig, SentenceEncoder
from capability.model.heads import ClassifierHead, LinearHead, linear_head_from_zero_shot
from capability.model.static import (
    STATIC_ZERO_SHOT_SCALE,
    StaticEmbeddingEncoder,
    StaticEncoderConfig,
)
from capability.model.tokenizer import EncodedText, TextTokenizer, TokenBatch, TokenizerFailed
from capability.model.zero_shot import (
    DEFAULT_LABELS,
    DEFAULT_SCALE,
    LabelSpec,
    ZeroShotHead,
    label_prototype_text,
)

__all__ = [
    "DEFAULT_GRAPH",
    "DEFAULT_LABELS",
    "DEFAULT_SCALE",
    "GRAPHS",
    "PRECISION_DTYPES",
    "STATIC_ZERO_SHOT_SCALE",
    "ClassifierHead",
    "ClassifyBatchResult",
    "EncodedText",
    "EncoderConfig",
    "LabelSpec",
    "LinearHead",
    "SentenceEncoder",
    "StaticEmbeddingEncoder",
    "StaticEncoderConfig",
    "TextClassifier",
    "TextEncoder",
    "TextTokenizer",
    "TokenBatch",
    "TokenizerFailed",
    "ZeroShotHead",
    "embed_label_prototypes",
    "label_prototype_text",
    "linear_head_from_zero_shot",
]
