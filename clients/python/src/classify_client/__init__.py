"""classify-client: sync and asyncio clients of the classify service (ai.classify.v1).

    from classify_client import ClassifyClient

    with ClassifyClient("127.0.0.1:50051", api_key=key) as client:
        print(client.classify("The striker scored twice", wait=True).labels[0].name)

`AsyncClassifyClient` has the same calls, awaited. Errors are the typed
classes of `classify_client.errors`; retries and polling follow
`classify_client.retry`. The generated stubs of the contract are
`classify_client.gen.ai.classify.v1` (the messages also as `classify_client.pb`).
"""

from classify_client._shared import (
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT_SECONDS,
    BatchItem,
    Priority,
)
from classify_client.aio import AsyncClassifyClient
from classify_client.client import ClassifyClient
from classify_client.errors import (
    ClassifyError,
    ClientError,
    DeadlineExpired,
    FieldViolation,
    InternalError,
    InvalidRequest,
    MessageTooLarge,
    NotFound,
    Overloaded,
    RateLimited,
    ResultNotFound,
    StillProcessing,
    Unauthenticated,
    Unavailable,
)
from classify_client.gen.ai.classify.v1 import classify_service_pb2 as pb
from classify_client.retry import PollPolicy, RetryEvent, RetryPolicy

# The distribution's version (pyproject.toml's; tests/unit/client/test_package.py).
__version__ = "0.3.0"

__all__ = [
    "DEFAULT_TARGET",
    "DEFAULT_TIMEOUT_SECONDS",
    "AsyncClassifyClient",
    "BatchItem",
    "ClassifyClient",
    "ClassifyError",
    "ClientError",
    "DeadlineExpired",
    "FieldViolation",
    "InternalError",
    "InvalidRequest",
    "MessageTooLarge",
    "NotFound",
    "Overloaded",
    "PollPolicy",
    "Priority",
    "RateLimited",
    "ResultNotFound",
    "RetryEvent",
    "RetryPolicy",
    "StillProcessing",
    "Unauthenticated",
    "Unavailable",
    "__version__",
    "pb",
]
