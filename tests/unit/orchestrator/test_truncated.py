"""A text longer than the model reads is cut before it is classified, and the answer
says so, through the front door, for a Classify call and for each batch item."""

from __future__ import annotations

import grpc

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER

# About 3,000 tokens of headline: far past topic-minilm's 256.
LONG = " ".join([STRIKER] * 250)


async def test_a_cut_text_is_answered_truncated_and_a_whole_one_is_not(
    orchestrator: OrchestratorServer,
) -> None:
    """docs/models.md said a cut text is reported truncated; only a span attribute
    said so, which a caller does not see."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        long = await stub.Classify(pb.ClassifyRequest(text=LONG), timeout=30)
        short = await stub.Classify(pb.ClassifyRequest(text=STRIKER), timeout=30)
        batch = await stub.ClassifyBatch(
            pb.ClassifyBatchRequest(
                items=[pb.ClassifyRequest(text=STRIKER), pb.ClassifyRequest(text=LONG)]
            ),
            timeout=30,
        )
    assert (long.truncated, short.truncated) == (True, False)
    assert [result.response.truncated for result in batch.results] == [False, True]
    assert long.labels[0].name == "sports"
