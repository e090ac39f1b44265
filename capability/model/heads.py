"""Classification heads over sentence embeddings: the linear head, and the set of head kinds.

`ZeroShotHead` (zero_shot.py) needs no training: each label is a prototype embedding.
`LinearHead` is one weight row and one bias per label over the encoder's sentence
embedding, softmax over the logits. Its parameters carry the names a Hugging Face
sequence classifier's head has (`classifier.weight`, `classifier.bias`), but NOTE: the
names fit, the inputs do not. A `BertForSequenceClassification` head reads the [CLS]
token through a pooler (dense + tanh); this head reads the mean of every token's vector
scaled to unit length. Such a head loads without complaint and scores wrongly: only a
head trained on this encoder's mean-pooled, normalised embeddings belongs here.

A zero-shot head is a linear head with W = scale * prototypes and b = 0, which
`linear_head_from_zero_shot` writes out; a trained head can later replace it without
touching the encoder.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from capability.model.zero_shot import ZeroShotHead


class LinearHead(nn.Module):
    """Sentence embeddings (B, H) -> label probabilities (B, L) via softmax(W e + b)."""

    def __init__(self, num_labels: int, hidden_size: int) -> None:
        super().__init__()
        assert num_labels >= 1, "a classifier needs at least one label"
        assert hidden_size >= 1, "embeddings need at least one dimension"
        self.classifier = nn.Linear(hidden_size, num_labels)

    @property
    def num_labels(self) -> int:
        return self.classifier.out_features

    @property
    def hidden_size(self) -> int:
        return self.classifier.in_features

    def forward(self, embeddings: Tensor) -> Tensor:
        logits = self.classifier(embeddings)  # (B, L)
        return torch.softmax(logits, dim=1)  # (B, L)


# Every head a classifier can end in; a closed set because the bundle format names each.
ClassifierHead = ZeroShotHead | LinearHead


def linear_head_from_zero_shot(head: ZeroShotHead) -> LinearHead:
    """The linear head computing what `head` computes: W = scale * prototypes, b = 0.

    Exact for unit-length embeddings, which every encoder here returns; the zero-shot head
    normalises its input again, so for other inputs the two differ by the input's norm.
    """
    num_labels, hidden_size = head.prototypes.shape
    with torch.device(head.prototypes.device):
        linear = LinearHead(num_labels, hidden_size)
    with torch.no_grad():
        linear.classifier.weight.copy_(head.scale * head.prototypes)  # (L, H)
        linear.classifier.bias.zero_()  # (L,)
    return linear.eval()
