"""The classifier the servers call: tokenizer + sentence encoder + head.

`TextClassifier` works with any encoder in `TextEncoder` (the BERT encoder, or the static
word-vector average) and any head in `ClassifierHead` (zero-shot prototypes, or linear).
It reads no files: model bundles (capability.bundle.loader) build one from their own
files, and `capability.bundle.minilm.load_minilm_classifier` builds one straight from a
sentence-transformers folder.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from capability.model.encoder import SentenceEncoder
from capability.model.heads import ClassifierHead
from capability.model.stages import NoClock, StageClock
from capability.model.static import StaticEmbeddingEncoder
from capability.model.tokenizer import EncodedText, TextTokenizer, TokenBatch
from capability.model.zero_shot import LabelSpec, label_prototype_text

# Every sentence encoder a classifier can run; a closed set because the bundle format
# names each architecture.
TextEncoder = SentenceEncoder | StaticEmbeddingEncoder

# The numeric precisions an encoder can compute in. bf16 casts the encoder's weights, so
# every matmul runs in bfloat16: on the project's 2-core Xeon test machine (AMX) that gave
# 1.5-1.6x the fp32 throughput at batch 32 and ~10% lower single-text latency (see
# bench/model_quality.py), while CPU autocast (fp32 weights, cast per op) gave 1.45x the
# throughput but 2.4x the single-text latency, paying a weight cast on every call. Heads
# always compute in float32: they are tiny, and a bf16 cosine (3 significant digits)
# times a scale of 40 would move logits by ~0.04.
PRECISION_DTYPES: Mapping[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}

# How a batch's forward (encoder and head) runs. "eager" calls the PyTorch modules op by
# op from Python. "torchscript" traces them once into one graph that runs in C++ without
# holding the GIL: with another Python thread busy (as a serving loop is), a batch of 32
# took 125 ms traced against 1,130 ms eager on the 2-core test machine, with identical
# outputs. The head is in the same graph because every op called from Python gives up
# the GIL and must win it back from the serving loop, up to a switch interval (5 ms)
# each time: the head alone was ~25 such waits per batch.
GRAPHS = ("torchscript", "eager")
# What serving uses unless told otherwise.
DEFAULT_GRAPH = "torchscript"
# Tokens per text of the example a graph is traced on (fewer for a model that reads
# fewer): sizes are traced as sizes, so any short length serves every length.
TRACE_TOKENS = 8
# Tokens per text for a call that names no `max_length`: the contract's "absent means
# 512", capped by the model's own maximum.
DEFAULT_TOKEN_BUDGET = 512


class Lanes(Protocol):
    """Computes a forward in row parts side by side (a CPU worker's cores:
    capability.workers.threads.CpuLanes)."""

    def score(
        self, fn: Callable[[Tensor, Tensor], Tensor], input_ids: Tensor, attention_mask: Tensor
    ) -> Tensor: ...


@dataclass(frozen=True)
class ClassifyBatchResult:
    """What one `classify` call found, one entry per input text, in input order."""

    probabilities: Tensor  # (B, L) float32 on the CPU; columns follow `TextClassifier.labels`
    token_counts: tuple[int, ...]  # tokens the model saw per text, [CLS]/[SEP] included
    truncated: tuple[bool, ...]  # whether the text was cut to fit the token budget


class TextClassifier:
    """Classifies texts into `labels`; owns the model and the device it runs on.

    `tokenize` touches only the (thread-safe) Rust tokenizer, so it may run on any number
    of threads while one thread calls `run`. `run`, `classify` and `warm_up` are not
    thread-safe: callers serialise them (the model would not run faster concurrently,
    and `forward_count` is a plain integer).
    """

    def __init__(
        self,
        *,
        tokenizer: TextTokenizer,
        encoder: TextEncoder,
        head: ClassifierHead,
        labels: Sequence[LabelSpec],
        max_seq_length: int,
        device: torch.device,
        precision: str = "fp32",
    ) -> None:
        if len(labels) != head.num_labels:
            raise ValueError(f"{len(labels)} labels but the head scores {head.num_labels}")
        if head.hidden_size != encoder.hidden_size:
            raise ValueError(
                f"the head reads {head.hidden_size}-wide embeddings but the encoder "
                f"returns {encoder.hidden_size}"
            )
        limit = encoder.max_tokens
        # token_budget never goes below the special tokens plus one token of text, so a
        # model must read at least that many, or a small max_length would overrun it.
        least = tokenizer.special_tokens_per_text + 1
        if max_seq_length < least or (limit is not None and max_seq_length > limit):
            raise ValueError(f"max_seq_length {max_seq_length} must be within [{least}, {limit}]")
        if precision not in PRECISION_DTYPES:
            raise ValueError(
                f"precision must be one of {sorted(PRECISION_DTYPES)}, got {precision!r}"
            )
        self.tokenizer = tokenizer
        # `.to(dtype)` is a no-op when a loader already built the encoder in this precision.
        self.encoder = encoder.to(dtype=PRECISION_DTYPES[precision]).eval()
        self.head = head.float().eval()
        self.labels: tuple[LabelSpec, ...] = tuple(labels)
        # The longest input the model was trained for; callers may ask for less, never more.
        self.max_seq_length = max_seq_length
        self.device = device
        self.precision = precision
        # Model forward passes so far, warm-up included; exported as a metric, and how
        # tests prove a rejected request never reached the model.
        self.forward_count = 0
        self.graph = "eager"
        self._score: Callable[[Tensor, Tensor], Tensor] = ScoringModel(self.encoder, self.head)

    def use_graph(self, graph: str) -> None:
        """Run each batch's forward as `graph` (see GRAPHS) from now on."""
        if graph not in GRAPHS:
            raise ValueError(f"graph must be one of {GRAPHS}, got {graph!r}")
        scoring = ScoringModel(self.encoder, self.head)
        if graph == "eager":
            self._score = scoring
        else:
            example = [self.tokenizer.stand_in(min(TRACE_TOKENS, self.max_seq_length))] * 2
            self._score = trace_scoring(scoring, self.tokenizer.collate(example))
        self.graph = graph

    def token_budget(self, max_length: int | None) -> int:
        """Tokens per text a call may use: the caller's limit, capped by the model's own,
        and never less than the special tokens plus one token of text. The contract
        allows budgets from 1 and promises truncation, not refusal; a budget below
        [CLS] + [SEP] would leave the tokenizer nothing to keep."""
        if max_length is None:
            # The contract's default, capped as any budget is: the model's own maximum
            # read 1,024 tokens for a bundle that allows them (a static-embedding one).
            return min(DEFAULT_TOKEN_BUDGET, self.max_seq_length)
        least = self.tokenizer.special_tokens_per_text + 1
        return max(min(max_length, self.max_seq_length), least)

    def classify(self, texts: Sequence[str], max_length: int | None = None) -> ClassifyBatchResult:
        """Label probabilities for each text, truncated to `token_budget(max_length)` tokens."""
        return self.run(self.tokenize(texts, max_length))

    def tokenize(self, texts: Sequence[str], max_length: int | None = None) -> list[EncodedText]:
        """Each text's token ids within `token_budget(max_length)`; no model work."""
        return self.tokenizer.encode_each(texts, self.token_budget(max_length))

    @torch.inference_mode()
    def run(
        self,
        encoded: Sequence[EncodedText],
        clock: StageClock | None = None,
        lanes: Lanes | None = None,
    ) -> ClassifyBatchResult:
        """Pad already-tokenized texts to the longest of them and run the model once.

        `clock` is marked at each of capability.model.stages.MARKS, the stages' bounds.
        `lanes` computes the forward in row parts side by side (a CPU worker's cores).
        """
        clock = clock or NoClock()
        clock.mark("started")
        batch = self.tokenizer.collate(encoded)
        clock.mark("assembled")
        if batch.lengths:
            input_ids, attention_mask = self._to_device(batch)
            clock.mark("copied")
            self.forward_count += 1
            if lanes is None:
                probabilities = self._score(input_ids, attention_mask)  # (B, L) float32
            else:
                probabilities = lanes.score(self._score, input_ids, attention_mask)
            clock.mark("forwarded")
            if probabilities.device.type != "cpu":
                probabilities = probabilities.cpu()
        else:
            # An empty request has nothing to run; answering without a forward keeps
            # `forward_count` equal to the passes the model really made.
            clock.mark("copied")
            clock.mark("forwarded")
            probabilities = torch.empty((0, len(self.labels)))
        clock.mark("done")
        return ClassifyBatchResult(
            probabilities=probabilities,
            token_counts=batch.lengths,
            truncated=batch.truncated,
        )

    @torch.inference_mode()
    def embed(self, texts: Sequence[str], max_length: int | None = None) -> Tensor:
        """Unit-length float32 sentence embeddings (B, H), on the model's device.

        Runs the encoder eagerly whatever `graph` is: this is for analysis, not serving.
        """
        batch = self.tokenizer.encode(texts, self.token_budget(max_length))
        if not batch.lengths:
            return torch.empty((0, self.encoder.hidden_size), device=self.device)
        self.forward_count += 1
        embeddings: Tensor = self.encoder(*self._to_device(batch))
        return embeddings  # (B, H)

    def warm_up(self) -> None:
        """Run one small batch so first-request latency excludes allocator and kernel setup."""
        self.classify(["warm-up text for the classifier", "a second, longer warm-up text " * 4])

    def memory_bytes(self) -> int:
        """Bytes the model's parameters and buffers occupy on `device`."""
        tensors = [
            *self.encoder.parameters(),
            *self.encoder.buffers(),
            *self.head.parameters(),
            *self.head.buffers(),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _to_device(self, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        """The batch's ids and mask on the model's device, lengths checked."""
        # A traced graph keeps no Python checks, so the one that protects a CUDA
        # device from an out-of-table position lookup is made here.
        if batch.input_ids.shape[1] > self.max_seq_length:
            raise ValueError(f"{batch.input_ids.shape[1]} tokens exceed {self.max_seq_length}")
        if self.device.type == "cpu":
            # Already there; even a `.to` that changes nothing gives up the GIL.
            return batch.input_ids, batch.attention_mask
        input_ids = batch.input_ids.to(self.device, non_blocking=True)  # (B, T)
        attention_mask = batch.attention_mask.to(self.device, non_blocking=True)  # (B, T)
        return input_ids, attention_mask


class ScoringModel(nn.Module):
    """Encoder then head, one module: token ids (B, T) -> label probabilities (B, L).

    One module so that one traced graph, a single call from Python, runs a batch.
    """

    def __init__(self, encoder: TextEncoder, head: ClassifierHead) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        embeddings = self.encoder(input_ids, attention_mask)  # (B, H) float32
        probabilities: Tensor = self.head(embeddings)  # (B, L) float32
        return probabilities


def trace_scoring(scoring: ScoringModel, example: TokenBatch) -> Callable[[Tensor, Tensor], Tensor]:
    """Encoder and head as one TorchScript graph, traced once on `example`, a small
    batch of the model's own token ids (any id past its vocabulary fails the trace).

    The forwards have no data-dependent control flow, and sizes are traced as sizes,
    so the graph serves any batch size and length with the eager outputs. Tracing
    warns about the shape checks it drops (made by TextClassifier instead) and about
    torch.jit being deprecated in favour of torch.compile, which needs a compiler
    toolchain at run time; the warnings are silenced here.
    """
    device = next(scoring.parameters()).device
    input_ids = example.input_ids.to(device)  # (B, T)
    attention_mask = example.attention_mask.to(device)  # (B, T)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced: Callable[[Tensor, Tensor], Tensor] = torch.jit.trace(  # type: ignore[no-untyped-call]
            scoring, (input_ids, attention_mask), check_trace=False
        )
    return traced


def embed_label_prototypes(
    encoder: TextEncoder,
    tokenizer: TextTokenizer,
    labels: Sequence[LabelSpec],
    max_length: int,
    device: torch.device,
) -> Tensor:
    """Each label's prototype (L, H): the encoder's embedding of `label_prototype_text`.

    A zero-shot head compares texts with these, so they must come from the same encoder
    (and tokenizer) that will embed the texts.
    """
    texts = [label_prototype_text(label) for label in labels]
    with torch.inference_mode():
        batch = tokenizer.encode(texts, max_length)
        prototypes: Tensor = encoder(
            batch.input_ids.to(device), batch.attention_mask.to(device)
        )  # (L, H)
    # Cloned out of inference mode so the result is an ordinary tensor that later
    # `.to()` calls or state-dict loads may touch.
    return prototypes.clone()
