"""The text classifier behind the capability servers: all-MiniLM-L6-v2 plus a zero-shot head."""

from capability.model.classifier import (
    ClassifyBatchResult,
    TextClassifier,
    load_minilm_classifier,
)
from capability.model.encoder import EncoderConfig, SentenceEncoder
from capability.model.errors import ModelLoadError
from capability.model.tokenizer import EncodedText, TextTokenizer, TokenBatch
from capability.model.zero_shot import (
    DEFAULT_LABELS,
    DEFAULT_SCALE,
    LabelSpec,
    ZeroShotHead,
    label_prototype_text,
)

__all__ = [
    "DEFAULT_LABELS",
    "DEFAULT_SCALE",
    "ClassifyBatchResult",
    "EncodedText",
    "EncoderConfig",
    "LabelSpec",
    "ModelLoadError",
    "SentenceEncoder",
    "TextClassifier",
    "TextTokenizer",
    "TokenBatch",
    "ZeroShotHead",
    "label_prototype_text",
    "load_minilm_classifier",
]
