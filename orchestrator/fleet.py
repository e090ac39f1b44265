"""The fleet's models, for the orchestrator's ModelService.

Listing and describing go to the capability replicas; any authenticated caller
may use them. Replicas need not agree: a fleet reload some replica refused, or
one under way, leaves a model served at two versions, and a bundle rebuilt under
one version at two digests. ListModels then lists the model once per version
served, so the split shows; GetModel describes the version most replicas serve,
counts the replicas at each version in `served_versions` (and how many it asked
and heard from), and logs the split. ReloadModel needs the
admin role and reaches every replica of every backend that serves the model,
so a fleet switches versions with one call; when some replica does not take
it, the answer says how many did and why each other did not
(`_reload_failure`). Capability servers themselves accept it only with the
internal token, which only the orchestrator holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from ai.classify.v1 import model_service_pb2 as model_pb
from ai.classify.v1 import model_service_pb2_grpc as model_pb_grpc
from classify_common.context import REQUEST_ID_HEADER, current_request
from classify_common.errors import (
    DeadlineExpired,
    ModelNotFound,
    ModelUnavailable,
    PermissionDenied,
    ReloadRefused,
    ServiceError,
)
from classify_common.tracing import inject_context
from orchestrator.calls import RoutingState
from orchestrator.dispatch import Dispatcher
from orchestrator.security.gate import current_caller
from orchestrator.upstream.errors import translate_upstream_error
from orchestrator.upstream.pool import BackendPool

log = logging.getLogger(__name__)

# How long GetModel waits for the other replicas once one has answered.
STRAGGLER_SECONDS = 1.0
# How long the check of a backend's model (check_backend_models) waits for a replica.
MODEL_CHECK_SECONDS = 5.0

ADMIN_ROLE = "admin"
OPERATOR_CALL_TIMEOUT_SECONDS = 120.0


class FleetModels:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    @contextlib.contextmanager
    def _routing_held(self) -> Iterator[RoutingState]:
        """The routes version in force, held for a whole operation: a routes reload
        meanwhile closes its channels once the operation is done. (Closed under it, a
        ReloadModel ended CANCELLED, unanswered, its later replicas never asked.)"""
        state = self._dispatcher.state
        state.enter()
        try:
            yield state
        finally:
            state.leave()

    @staticmethod
    def _replicas(state: RoutingState, model: str | None = None) -> list[Replica]:
        """(pool, address, its ModelService) of every distinct replica (each pod behind a
        name) in `state`, of one model's backends if given. The stubs are taken now: a
        pod that leaves while a reload walks the list fails its own call, not the walk."""
        seen: set[str] = set()
        replicas = []
        for pool in state.upstream.pools():
            if model is not None and pool.backend.model != model:
                continue
            for target in pool.replicas:
                if target not in seen:
                    seen.add(target)
                    replicas.append((pool, target, pool.model_service(target)))
        return replicas

    async def list_models(self, request: model_pb.ListModelsRequest) -> model_pb.ListModelsResponse:
        """Each model once per version its replicas serve (version and digest), sorted by
        name, the version most replicas serve first (the first asked among equals); each
        entry is the answer of the first replica that serves it. Every replica is asked
        at once, as GetModel asks them, and those that have not answered
        STRAGGLER_SECONDS after the first answer are left out: asked in turn, each
        frozen replica added its backend's whole timeout, and a caller with a shorter
        deadline got nothing although the others had answered. When none answers, the
        call fails as GetModel's does (an empty list said the fleet served nothing)."""
        with self._routing_held() as state:
            answers = await _answers_of(
                self._replicas(state), lambda replica: _list(replica, request)
            )
        served: dict[tuple[str, str, str], list[model_pb.ModelInfo]] = {}
        for listed in answers:  # in the order asked
            for info in listed.models:
                served.setdefault((info.name, info.version, info.digest), []).append(info)
        by_name = sorted(served.values(), key=lambda infos: (infos[0].name, -len(infos)))
        listed_models = [infos[0] for infos in by_name]
        for info in listed_models:
            _for_caller(info)
        return model_pb.ListModelsResponse(models=listed_models)

    async def get_model(self, request: model_pb.GetModelRequest) -> model_pb.GetModelResponse:
        """The version most of the model's replicas serve, every replica asked at once;
        replicas that serve another are logged. Those that have not answered
        STRAGGLER_SECONDS after the first answer are left out (asked in turn, or all
        waited for, one frozen replica held every call up to the backend's timeout).
        One that does not answer (down, or out of time) is passed over; when none
        answers, the answer is the first error that is not of that kind, else the
        last replica's."""
        with self._routing_held() as state:
            replicas = self._replicas(state, request.name)
            if not replicas:
                raise ModelNotFound(f"no backend serves model {request.name!r}", model=request.name)
            answers = await _answers_of(replicas, lambda replica: _describe(replica, request))
        return _most_served(request.name, answers, asked=len(replicas))

    async def reload_model(
        self, request: model_pb.ReloadModelRequest
    ) -> model_pb.ReloadModelResponse:
        caller = current_caller()
        if caller.role != ADMIN_ROLE:
            raise PermissionDenied("reloading a model needs the admin role", key=caller.key_id)
        answers: list[model_pb.ReloadModelResponse] = []
        failures: list[tuple[str, grpc.aio.AioRpcError]] = []
        with self._routing_held() as state:
            replicas = self._replicas(state, request.name)
            if not replicas:
                raise ModelNotFound(f"no backend serves model {request.name!r}", model=request.name)
            for pool, target, stub in replicas:
                try:
                    answers.append(
                        await stub.ReloadModel(
                            request,
                            timeout=OPERATOR_CALL_TIMEOUT_SECONDS,
                            metadata=_call_metadata(pool.credentials),
                        )
                    )
                except grpc.aio.AioRpcError as error:
                    translate_upstream_error(
                        error, pool.backend.name, target, classifying=False
                    )  # logs it
                    failures.append((pool.backend.name, error))
        log.info(
            "fleet reload",
            extra={"model": request.name, "reloaded": len(answers), "failed": len(failures)},
        )
        if failures:
            raise _reload_failure(request.name, len(replicas), failures)
        return answers[0]


# Codes of a replica that did not answer: the call says nothing of the model.
_NO_ANSWER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


async def _answers_of(
    replicas: Sequence[Replica], ask: Callable[[Replica], Awaitable[T]]
) -> list[T]:
    """Every replica asked at once; the answers of those that answered by
    STRAGGLER_SECONDS after the first did, in the order asked. With none (of some
    asked), the failure _first_telling picks is raised."""
    asked = [asyncio.ensure_future(ask(replica)) for replica in replicas]
    try:
        await _first_answers(asked, STRAGGLER_SECONDS)
    finally:
        for task in asked:
            task.cancel()
        await asyncio.gather(*asked, return_exceptions=True)
    answered = [task for task in asked if task.done() and not task.cancelled()]
    answers = [task.result() for task in answered if task.exception() is None]
    if asked and not answers:
        raise _first_telling(answered)
    return answers


def _first_telling(failed: Sequence[asyncio.Future[Any]]) -> BaseException:
    """What a fleet call answers when no replica did: the first error that says more
    than "no answer" (down, or out of time), else the last replica's."""
    errors = [error for t in failed if (error := t.exception()) is not None]
    unanswered = (ModelUnavailable, DeadlineExpired)
    return next((e for e in errors if not isinstance(e, unanswered)), errors[-1])


# A replica as fleet calls take it: its backend's pool, its address, its ModelService.
Replica = tuple[BackendPool, str, "model_pb_grpc.ModelServiceAsyncStub"]  # the stub: typing only
T = TypeVar("T")


async def _ask(replica: Replica, method: str, request: Any) -> Any:
    """`method` of the replica's ModelService, within its backend's timeout; a failure
    as the ServiceError it means (logged)."""
    pool, target, stub = replica
    try:
        return await getattr(stub, method)(
            request,
            timeout=pool.backend.timeout_seconds,
            metadata=_call_metadata(pool.credentials),
        )
    except grpc.aio.AioRpcError as error:
        raise translate_upstream_error(
            error, pool.backend.name, target, classifying=False
        ) from error


async def _list(
    replica: Replica, request: model_pb.ListModelsRequest
) -> model_pb.ListModelsResponse:
    response: model_pb.ListModelsResponse = await _ask(replica, "ListModels", request)
    return response


async def _describe(
    replica: Replica, request: model_pb.GetModelRequest
) -> model_pb.GetModelResponse:
    response: model_pb.GetModelResponse = await _ask(replica, "GetModel", request)
    _for_caller(response.model)
    return response


async def check_backend_models(pools: Sequence[BackendPool]) -> None:
    """Ask each replica of `pools` whether it serves its backend's `model`, and log at
    WARNING each backend whose replicas say they do not (NOT_FOUND), naming them. A
    misspelt `model` in routes.yaml passes `check` and a reload (no file says what a
    replica serves), and then every call of its routes failed MODEL_NOT_SERVED or
    fell back, with no word at the edit. A replica still loading the model serves it;
    one that does not answer says nothing (down, or not started yet)."""

    async def serves(pool: BackendPool, target: str) -> bool | None:
        request = model_pb.GetModelRequest(name=pool.backend.model)
        try:
            await pool.model_service(target).GetModel(
                request, timeout=MODEL_CHECK_SECONDS, metadata=pool.credentials
            )
        except grpc.aio.AioRpcError as error:
            return False if error.code() == grpc.StatusCode.NOT_FOUND else None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the check itself was cancelled (the server stops)
            # The replica's channel was closed under the call: a name's first look-up
            # replaced it with a channel per address, or a later edit closed the pool.
            return None
        except (grpc.aio.UsageError, KeyError):
            return None  # the pool (or this replica's channel) was closed meanwhile
        return True

    async def check(pool: BackendPool) -> None:
        targets = pool.replicas
        answers = await asyncio.gather(*(serves(pool, target) for target in targets))
        if targets != pool.replicas and None in answers:
            # A name looked up while it was asked (its first look-up, on Kubernetes):
            # ask the addresses it stands for.
            targets = pool.replicas
            answers = await asyncio.gather(*(serves(pool, target) for target in targets))
        without = [t for t, served in zip(targets, answers, strict=True) if served is False]
        if without:
            log.warning(
                "backend names a model its replicas do not serve",
                extra={
                    "backend": pool.backend.name,
                    "model": pool.backend.model,
                    "targets": without,
                    "replicas": len(targets),
                },
            )

    await asyncio.gather(*(check(pool) for pool in pools))


async def _first_answers(asked: Sequence[asyncio.Future[Any]], straggler_seconds: float) -> None:
    """Wait until one of `asked` has an answer (or all have failed), then up to
    `straggler_seconds` more for the others."""
    pending = set(asked)
    while pending and not any(t.done() and t.exception() is None for t in asked):
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    if pending:
        await asyncio.wait(pending, timeout=straggler_seconds)


def _most_served(
    model: str, answers: Sequence[model_pb.GetModelResponse], *, asked: int
) -> model_pb.GetModelResponse:
    """The answer of the version (and digest) most replicas serve, the first asked among
    equals (a replica whose model is still loading serves none), with the replicas at
    every version and state in `served_versions`, and `asked` replicas of which
    `answers` answered. A split is logged."""
    serving = [a for a in answers if a.model.state != model_pb.MODEL_STATE_LOADING] or answers
    counts = Counter((a.model.version, a.model.digest) for a in serving)
    chosen = model_pb.GetModelResponse()
    chosen.CopyFrom(max(serving, key=lambda a: counts[(a.model.version, a.model.digest)]))
    # Counter keeps first-seen order among equal counts: the first asked comes first.
    at = Counter((a.model.version, a.model.digest, a.model.state) for a in answers)
    chosen.served_versions.extend(
        model_pb.ServedVersion(version=version, digest=digest, state=state, replicas=replicas)
        for (version, digest, state), replicas in at.most_common()
    )
    chosen.replicas_asked = asked
    chosen.replicas_answered = len(answers)
    if len(counts) > 1:
        served = ", ".join(
            f"{version} ({digest[:12]}) on {replicas}"
            for (version, digest), replicas in counts.most_common()
        )
        log.warning(
            "replicas serve different versions of the model",
            extra={"model": model, "served": served, "described": chosen.model.version},
        )
    return chosen


def _reload_failure(
    model: str, replicas: int, failures: Sequence[tuple[str, grpc.aio.AioRpcError]]
) -> ServiceError:
    """What a fleet reload answers when some replica did not take it; the others did.

    A replica that refused keeps its version, and its message (which names the bundle
    file that failed) is for the admin who asked; one that did not answer is named by
    its backend only, the reason staying in the log. Any refusal makes the answer
    FAILED_PRECONDITION (NOT_FOUND when every replica lacks the version); replicas
    that only did not answer make it UNAVAILABLE: a retry reaches them, and reloading
    the same version again is harmless to those that took it.
    """
    parts = [
        f"{backend}: did not answer ({error.code().name})"
        if error.code() in _NO_ANSWER
        else f"{backend}: {error.details()}"
        for backend, error in failures
    ]
    reloaded = replicas - len(failures)
    message = f"{reloaded} of {replicas} replicas reloaded {model}; " + "; ".join(parts)
    codes = {error.code() for _, error in failures}
    if codes == {grpc.StatusCode.NOT_FOUND} and reloaded == 0:
        return ModelNotFound(message, model=model, failed=len(failures))
    if codes <= _NO_ANSWER:
        return ModelUnavailable(message, model=model, failed=len(failures))
    return ReloadRefused(message, model=model, failed=len(failures))


def _call_metadata(credentials: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """An operator call's metadata towards a replica: its credentials, and the caller's
    trace context and request ID, so that the replica's half of the call joins the
    caller's trace and logs under its request."""
    ids = current_request()
    request_id = ((REQUEST_ID_HEADER, ids.request_id),) if ids is not None else ()
    return (*inject_context(), *request_id, *credentials)


def _for_caller(info: model_pb.ModelInfo) -> None:
    """What a caller who is not an admin is told of a model: no server path (`source`),
    no device memory readings, and no refused versions (their reasons name server
    paths); the rest (name, version, labels, digest) is the contract a client needs."""
    if current_caller().role == ADMIN_ROLE:
        return
    info.ClearField("source")
    info.ClearField("memory")
    info.ClearField("refused_versions")
