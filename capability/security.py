"""Capability servers answer only the orchestrator: every contract call must carry the
shared internal token, so no one can skip authentication, rate limits or routing
by calling a model server directly. Health and reflection stay open for probes.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from classify_common.admission import RateAllowance
from classify_common.context import INTERNAL_TOKEN_HEADER
from classify_common.errors import Unauthenticated

# The one caller a capability server serves.
ORCHESTRATOR = "orchestrator"


class InternalTokenGate:
    """The interceptor's gate (classify_common.admission.Gate) for capability servers."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def authenticate(self, method: str, metadata: Mapping[str, str]) -> str:
        if not self.identifies(metadata):
            raise Unauthenticated("capability servers answer the orchestrator only")
        return ORCHESTRATOR

    def identifies(self, metadata: Mapping[str, str]) -> bool:
        sent = metadata.get(INTERNAL_TOKEN_HEADER, "").encode()
        return hmac.compare_digest(sent, self._token)

    async def check_rate_limit(self, tenant: str, calls: int = 1) -> RateAllowance:
        return RateAllowance(None, calls)  # overload is the bounded queue's job here
