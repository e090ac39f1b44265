"""Capability servers answer only the orchestrator: every contract call must carry the
shared internal token, so no one can skip authentication, rate limits or routing
by calling a model server directly. Health and reflection stay open for probes.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from classify_common.context import INTERNAL_TOKEN_HEADER
from classify_common.errors import Unauthenticated


class InternalTokenGate:
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def __call__(self, method: str, metadata: Mapping[str, str]) -> None:
        sent = metadata.get(INTERNAL_TOKEN_HEADER, "").encode()
        if not hmac.compare_digest(sent, self._token):
            raise Unauthenticated("capability servers answer the orchestrator only")
