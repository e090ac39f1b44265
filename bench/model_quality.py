"""Model quality and speed: topic-minilm (fp32, bf16) and topic-static, side by side.

For each configuration, on the 88 labelled headlines in tests/data/headlines.json:

- accuracy: top-1 label against the hand-assigned one;
- agreement: top-1 label equal to topic-minilm fp32's (the served reference);
- throughput: texts per second at batch 32, the forward pass alone (pre-tokenized, as
  the serving workers see it) and with tokenization included;
- latency: one text at a time through `classify` (tokenize + forward), median and p95.

Bundles are built fresh into a temporary directory, every configuration runs in this one
process with the same torch threads, so the ratios mean something on a shared machine.
Prints a table and writes build/bench/model_quality.json.

    .venv/bin/python bench/model_quality.py [--threads N] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from capability.bundle import build_bundle, load_bundle  # noqa: E402
from capability.model import TextClassifier  # noqa: E402

HEADLINES_FILE = REPO_ROOT / "tests" / "data" / "headlines.json"
RESULTS = REPO_ROOT / "build" / "bench" / "model_quality.json"
CONFIGURATIONS = (("topic-minilm", "fp32"), ("topic-minilm", "bf16"), ("topic-static", "fp32"))
BATCH_SIZE = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="measuring time per throughput figure"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = json.loads(HEADLINES_FILE.read_text(encoding="utf-8"))
    texts = [row["text"] for row in rows]
    labels = [row["label"] for row in rows]

    results: list[dict[str, object]] = []
    reference_top: list[str] | None = None
    with tempfile.TemporaryDirectory(prefix="model-quality-") as root:
        bundles = {
            kind: build_bundle(kind, Path(root) / kind / "1", progress=False)
            for kind in sorted({kind for kind, _ in CONFIGURATIONS})
        }
        for kind, precision in CONFIGURATIONS:
            loaded = load_bundle(bundles[kind], precision=precision)
            top = top_labels(loaded.classifier, texts)
            if reference_top is None:
                reference_top = top  # the first configuration is topic-minilm fp32
            latencies = single_text_latencies(loaded.classifier, texts)
            results.append(
                {
                    "model": kind,
                    "precision": precision,
                    "accuracy": mean_equal(top, labels),
                    "agreement_with_minilm_fp32": mean_equal(top, reference_top),
                    "texts_per_second_forward": throughput(
                        loaded.classifier, texts, args.seconds, include_tokenize=False
                    ),
                    "texts_per_second_with_tokenize": throughput(
                        loaded.classifier, texts, args.seconds, include_tokenize=True
                    ),
                    "latency_ms_p50": 1000 * statistics.median(latencies),
                    "latency_ms_p95": 1000 * statistics.quantiles(latencies, n=20)[-1],
                    "load_seconds": loaded.load_seconds,
                    "memory_bytes": loaded.memory_bytes,
                }
            )

    print_table(results, args.threads)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": args.threads,
        },
        "headlines": len(texts),
        "batch_size": BATCH_SIZE,
        "results": results,
    }
    RESULTS.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {RESULTS.relative_to(REPO_ROOT)}")


def top_labels(classifier: TextClassifier, texts: list[str]) -> list[str]:
    top: list[str] = []
    for start in range(0, len(texts), BATCH_SIZE):
        probabilities = classifier.classify(texts[start : start + BATCH_SIZE]).probabilities
        top += [classifier.labels[int(i)].name for i in probabilities.argmax(dim=1)]
    return top


def mean_equal(ours: list[str], theirs: list[str]) -> float:
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def throughput(
    classifier: TextClassifier, texts: list[str], seconds: float, *, include_tokenize: bool
) -> float:
    """Texts per second over full batches of 32 headlines, cycling through the set."""
    batches = [
        (texts * 2)[start : start + BATCH_SIZE] for start in range(0, len(texts), BATCH_SIZE)
    ]
    tokenized = [classifier.tokenize(batch) for batch in batches]
    for encoded in tokenized:  # warm-up: one pass over every batch shape
        classifier.run(encoded)
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for batch, encoded in zip(batches, tokenized, strict=True):
            if include_tokenize:
                classifier.classify(batch)
            else:
                classifier.run(encoded)
            done += len(batch)
    return done / (time.perf_counter() - started)


def single_text_latencies(classifier: TextClassifier, texts: list[str]) -> list[float]:
    for text in texts[:8]:
        classifier.classify([text])
    latencies = []
    for text in texts * 2:
        started = time.perf_counter()
        classifier.classify([text])
        latencies.append(time.perf_counter() - started)
    return latencies


def print_table(results: list[dict[str, object]], threads: int) -> None:
    header = (
        f"{'model':<14}{'precision':<11}{'accuracy':>9}{'agree':>8}"
        f"{'fwd texts/s':>13}{'+tok texts/s':>14}{'p50 ms':>8}{'p95 ms':>8}{'MB':>7}"
    )
    print(f"{len(results)} configurations, batch {BATCH_SIZE}, torch threads {threads}\n")
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['model']!s:<14}{r['precision']!s:<11}"
            f"{_f(r['accuracy']):>9.3f}{_f(r['agreement_with_minilm_fp32']):>8.3f}"
            f"{_f(r['texts_per_second_forward']):>13.0f}"
            f"{_f(r['texts_per_second_with_tokenize']):>14.0f}"
            f"{_f(r['latency_ms_p50']):>8.2f}{_f(r['latency_ms_p95']):>8.2f}"
            f"{_f(r['memory_bytes']) / 1e6:>7.1f}"
        )


def _f(value: object) -> float:
    assert isinstance(value, int | float)
    return float(value)


if __name__ == "__main__":
    main()
