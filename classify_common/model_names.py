"""The contract's rule for model names, for every check outside the contract.

ClassifyRequest.model, GetModelRequest.name and ReloadModelRequest.name carry it as
buf.validate options (proto/ai/classify/v1/); the model folders a capability server
serves and the models routes.yaml names are checked against the same rule here, and
a test holds the two equal.
"""

from __future__ import annotations

import re

MODEL_NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$"
MODEL_NAME_MAX_CHARS = 64
# How the rule reads in an error message.
MODEL_NAME_RULE = (
    f"lowercase letters, digits, '.', '_', '-', starting and ending with a letter or "
    f"digit, at most {MODEL_NAME_MAX_CHARS} characters"
)

_MODEL_NAME = re.compile(MODEL_NAME_PATTERN)


def is_model_name(text: object) -> bool:
    """Whether `text` is a model name the contract accepts."""
    return (
        isinstance(text, str)
        and len(text) <= MODEL_NAME_MAX_CHARS
        and _MODEL_NAME.fullmatch(text) is not None
    )
