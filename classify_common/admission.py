"""Admission: who may call, how often, and with what, before a handler runs.

Each server admits a contract call through the `Gate` it was given (API keys or
the internal token, and the tenant's rate limit) and the contract's
protovalidate rules (classify_common.validation). An invalid or refused request
reaches no handler, let alone a model.
- The public front door (the orchestrator, `FrontDoorAdmission`) runs each step
  as a lifecycle node of its own: `auth_validate`, `rate_limit_check`,
  `input_validate`, once the request's IDs are bound.
- An internal server (`InternalAdmission`) runs them inside its
  `capability_receive` node.

A batch call (`ClassifyBatch`) is admitted once. Its items are checked one by
one: an item that breaks the item rules, or that the tenant's rate limit (one
token per item) does not cover, is refused on its own and recorded for the
handler (classify_common.intake); only the batch's own rules and a refused
caller fail the whole call.

The request lifecycle (classify_common.interceptor) builds one admission per
contract method when it first wraps the method, so nothing here asks per call
which server or which method it serves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, cast

from opentelemetry import trace

from classify_common.errors import FieldViolation, InvalidRequest, ServiceError
from classify_common.intake import (
    BATCH_METHODS,
    MAX_BATCH_ITEMS,
    NO_REFUSALS,
    BatchIntake,
    bind_batch_intake,
    current_batch_intake,
    texts_in_batch,
)
from classify_common.nodes import (
    AUTH_VALIDATE,
    CAPABILITY_RECEIVE,
    CLASSIFY_OUTCOME,
    CLASSIFY_TENANT,
    CLASSIFY_TOKENS_LEFT,
    CLASSIFY_VIOLATION_FIELDS,
    CLASSIFY_VIOLATIONS,
    GRPC_RECEIVE,
    INPUT_VALIDATE,
    RATE_LIMIT_CHECK,
    node,
)
from classify_common.validation import validate_batch, validate_request, with_item_refusals


@dataclass(frozen=True)
class RateAllowance:
    """What a tenant's rate limit granted to one call of `calls` items."""

    tokens_left: float | None  # None: the tenant is not limited
    granted: int  # the first `granted` items may go ahead
    refusal: ServiceError | None = None  # answers the items past `granted`


class Gate(Protocol):
    """Who may call, and how often; each method raises a ServiceError to refuse."""

    def authenticate(self, method: str, metadata: Mapping[str, str]) -> str:
        """The caller's tenant, from the request metadata (lower-case keys; a credential
        header sent more than once reads REPEATED_CREDENTIAL)."""
        ...

    def identifies(self, metadata: Mapping[str, str]) -> bool:
        """Whether `authenticate` would accept the caller, without counting, binding or
        logging anything."""
        ...

    async def check_rate_limit(self, tenant: str, calls: int = 1) -> RateAllowance:
        """Take one token per call (a batch item is a call) from the tenant's allowance;
        raise when not even one is left. Only the front door asks: an internal server
        leaves overload to its bounded queues."""
        ...


# Admits a request: raises a ServiceError to refuse it. A coroutine: the tenant's
# rate limit may live in a shared store (orchestrator.state).
AdmitStep = Callable[[Mapping[str, str], Any], Awaitable[None]]
# Admits a request inside the receive node, recording on its span.
ReceiveStep = Callable[[Mapping[str, str], Any, trace.Span], None]


class Admission(Protocol):
    """One contract method's admission on one server. A step that a server does not
    take is None, so a call pays nothing for it."""

    # The lifecycle node that parses the request (and runs `on_receive`).
    receive_node: str
    # Whether the server's output steps (output_serialize, response_send) are nodes.
    times_output: bool
    # False for an internal batch call: its items are the requests, each with a trace
    # of its own that counts its nodes (RequestTrace.observes_own_nodes).
    counts_own_nodes: bool
    # Inside the receive node, right after parsing.
    on_receive: ReceiveStep | None
    # After the receive node, once the request's own IDs are bound.
    admit: AdmitStep | None
    # Whether the caller's `baggage` header is left unread (a public caller's).
    drops_caller_baggage: bool

    async def refuse_undecodable(
        self, headers: Mapping[str, str], error: InvalidRequest
    ) -> NoReturn:
        """Refuse a request that is not a message of the method: with `error`, once the
        caller's credentials (and at the front door its rate) pass, as any call's are
        checked before validation. Always raises."""
        ...

    def identifies(self, headers: Mapping[str, str]) -> bool:
        """Whether the caller's credentials would pass (no gate: anyone's), deciding
        nothing: the gate's own step still authenticates the call."""
        ...


# Checks a parsed request against the contract, recording on the span how it broke.
Validator = Callable[[Any, trace.Span], BatchIntake]


def admission_for(method: str, gate: Gate | None, *, edge: bool) -> Admission:
    """The admission of contract `method`; `edge`: on the public front door."""
    if edge:
        return FrontDoorAdmission(method, gate)
    return InternalAdmission(method, gate)


class _MethodChecks:
    """What both servers know of one method: its gate, and whether it is a batch."""

    def __init__(self, method: str, gate: Gate | None) -> None:
        self._method = method
        self._gate = gate
        self._is_batch = method in BATCH_METHODS
        self._validate: Validator = _validate_batch if self._is_batch else _validate_single

    def identifies(self, headers: Mapping[str, str]) -> bool:
        return self._gate is None or self._gate.identifies(headers)

    def _calls_in(self, request: Any) -> int:
        """How many calls a request counts as (one, or a batch's texts)."""
        return texts_in_batch(request) if self._is_batch else 1


class FrontDoorAdmission(_MethodChecks):
    receive_node = GRPC_RECEIVE
    times_output = True
    # A public caller's W3C baggage is not read: nothing here uses it, and parsing
    # it (before any authentication) logged a line per malformed entry: 181 lines
    # for one unauthenticated call.
    drops_caller_baggage = True
    counts_own_nodes = True

    def __init__(self, method: str, gate: Gate | None) -> None:
        super().__init__(method, gate)
        self.on_receive: ReceiveStep | None = None  # its steps are nodes of their own
        self.admit: AdmitStep | None = self._admit

    async def _admit(self, headers: Mapping[str, str], request: Any) -> None:
        """Who is calling, whether they may, and what, each as its own node."""
        tenant = self._authenticate(headers)
        calls = self._calls_in(request)
        allowance = RateAllowance(None, calls)
        with node(RATE_LIMIT_CHECK, {CLASSIFY_TENANT: tenant}) as span:
            if self._gate is not None:
                allowance = await self._gate.check_rate_limit(tenant, calls)
            if allowance.tokens_left is not None:
                span.set_attribute(CLASSIFY_TOKENS_LEFT, allowance.tokens_left)
        with node(INPUT_VALIDATE) as span:
            if self._is_batch:
                _ignore_callers_cache_scopes(request)
            intake = self._validate(request, span)
            # What the contract does not name goes no further: a request's unknown fields
            # travelled upstream, megabytes of them beside a short text, and merged calls
            # of such requests passed the capability's message limit (their texts'
            # characters, which the coalescer bounds, were far within it). After the
            # batch rules (at most 1,024 items to walk): 0.2 us a request, 4 us a batch
            # of 64.
            request.DiscardUnknownFields()
        if allowance.refusal is not None:
            # An item past the allowance is refused for it whatever else it broke, as
            # a single call of it would be: the rate limit is checked first.
            over_limit = dict.fromkeys(range(allowance.granted, calls), allowance.refusal)
            bind_batch_intake(BatchIntake({**intake.refused, **over_limit}))

    async def refuse_undecodable(
        self, headers: Mapping[str, str], error: InvalidRequest
    ) -> NoReturn:
        # Without a key such bytes were INVALID_ARGUMENT, uncounted as an auth failure,
        # and over the rate they were not RATE_LIMITED.
        tenant = self._authenticate(headers)
        with node(RATE_LIMIT_CHECK, {CLASSIFY_TENANT: tenant}):
            if self._gate is not None:
                await self._gate.check_rate_limit(tenant, 1)
        # Its refusal is validation's, as a rule broken would be: the trace of such
        # bytes lacked the node, which the docs promise an invalid request.
        with node(INPUT_VALIDATE) as span:
            _record_violations(span, error.violations)
            raise error

    def _authenticate(self, headers: Mapping[str, str]) -> str:
        with node(AUTH_VALIDATE) as span:
            if self._gate is None:
                span.set_attribute(CLASSIFY_OUTCOME, "not_configured")
                return ""
            try:
                tenant = self._gate.authenticate(self._method, headers)
            except ServiceError:
                span.set_attribute(CLASSIFY_OUTCOME, "refused")
                raise
            span.set_attributes({CLASSIFY_TENANT: tenant, CLASSIFY_OUTCOME: "ok"})
            return tenant


class InternalAdmission(_MethodChecks):
    receive_node = CAPABILITY_RECEIVE
    times_output = False
    drops_caller_baggage = False

    def __init__(self, method: str, gate: Gate | None) -> None:
        super().__init__(method, gate)
        self.counts_own_nodes = not self._is_batch
        self.on_receive: ReceiveStep | None = self._check_on_receive
        self.admit: AdmitStep | None = None  # admitted on receive

    async def refuse_undecodable(
        self, headers: Mapping[str, str], error: InvalidRequest
    ) -> NoReturn:
        if self._gate is not None:
            self._gate.authenticate(self._method, headers)
        raise error

    def _check_on_receive(self, headers: Mapping[str, str], request: Any, span: trace.Span) -> None:
        """The gate's authentication and validation, inside the receive node; no rate
        limit (see Gate.check_rate_limit)."""
        if self._gate is not None:
            self._gate.authenticate(self._method, headers)
        self._validate(request, span)


def _ignore_callers_cache_scopes(request: Any) -> None:
    """Clear what a public caller put in ItemContext.cache_scope: the orchestrator sets
    each item's scope from the caller's tenant, so the value is ignored, and must not
    get the item refused for its length either. Not in a batch the size rules refuse
    (validate_batch): a caller could send millions of contexts to walk."""
    if len(request.item_contexts) > MAX_BATCH_ITEMS:
        return
    for context in request.item_contexts:
        if context.cache_scope:
            context.ClearField("cache_scope")
    _forget_cache_scope_refusals()


def _forget_cache_scope_refusals() -> None:
    """Drop what the UTF-8 check (before any rule) refused in the scopes just cleared:
    a value that is ignored must not get its item refused for its bytes either."""
    intake = current_batch_intake()
    if not intake.refused:
        return
    kept: dict[int, ServiceError] = {}
    for index, error in intake.refused.items():
        if isinstance(error, InvalidRequest):
            left = [v for v in error.violations if not v.field.endswith(_CACHE_SCOPE_PATH_END)]
            if not left:
                continue
            if len(left) < len(error.violations):
                error = InvalidRequest(left)
        kept[index] = error
    bind_batch_intake(BatchIntake(kept))


# How a violation of an item's `ItemContext.cache_scope` ends its field path.
_CACHE_SCOPE_PATH_END = ".cache_scope"


def _validate_single(request: Any, span: trace.Span) -> BatchIntake:
    """Check a single call's request; raise InvalidRequest when it breaks a rule."""
    try:
        validate_request(request)
    except InvalidRequest as error:
        _record_violations(span, error.violations)
        raise
    span.set_attribute(CLASSIFY_VIOLATIONS, 0)
    return NO_REFUSALS


def _validate_batch(request: Any, span: trace.Span) -> BatchIntake:
    """Check a batch: its broken items are bound as its intake (and returned); a batch
    that breaks the batch rules raises InvalidRequest."""
    try:
        # Items whose strings were not UTF-8 were refused as the call arrived
        # (classify_common.interceptor).
        unreadable = current_batch_intake().refused
        intake = BatchIntake(with_item_refusals(validate_batch(request), unreadable))
    except InvalidRequest as error:
        _record_violations(span, error.violations)
        raise
    bind_batch_intake(intake)
    refused = cast(Mapping[int, InvalidRequest], intake.refused)
    violations = [v for error in refused.values() for v in error.violations]
    span.set_attribute(CLASSIFY_VIOLATIONS, len(violations))
    if violations:
        span.set_attribute(CLASSIFY_VIOLATION_FIELDS, [v.field for v in violations])
    return intake


def _record_violations(span: trace.Span, violations: Sequence[FieldViolation]) -> None:
    span.set_attributes(
        {
            CLASSIFY_VIOLATIONS: len(violations),
            CLASSIFY_VIOLATION_FIELDS: [v.field for v in violations],
        }
    )
