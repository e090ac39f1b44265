"""The addresses behind a backend's targets, so that every pod is a replica of its own.

A `dns:///name:port` target (a Kubernetes headless Service) names many pods.
Given to gRPC as one channel, round robin spreads the calls over all of them and
the orchestrator never learns which pod failed a call: a failing pod could not
be ejected, and with one target ejection was off altogether (never all).

gRPC's own answer, the outlier detection LB policy of gRFC A50
(`outlier_detection_experimental` in a service config), works in grpcio but
does not fit here:
- it counts every status but OK as a failure, so a pod that sheds load with
  RESOURCE_EXHAUSTED, or answers a spent deadline, is ejected and its load sent
  to the others, which are just as busy;
- it decides once per interval on a failure percentage, so a pod failing
  every call keeps getting calls until the interval ends;
- it ejects the only address unless `minimumHosts` is at least 2, and all of
  them unless `maxEjectionPercent` is at most 50;
- its ejections are invisible to the orchestrator's metrics and logs.

So the orchestrator looks names up itself, off the event loop (the loop's
getaddrinfo runs in a thread), looks again every `RESOLVE_INTERVAL_SECONDS` as
pods come and go, and the pool gives each address a channel of its own; the
outlier detector (orchestrator.policy.outliers) then counts and ejects per
address.

Target forms, as the routes file accepts them:
    10.0.0.5:50051   [fd00::5]:50051                one address, used as it is
    ipv4:10.0.0.5:50051,10.0.0.6:50051              a fixed list (ipv6:[a]:p,... too)
    capability:50051   dns:///capability:50051      a name, looked up every interval
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

# How often names are looked up again, seconds. CoreDNS's kubernetes plugin
# answers with a 5 s TTL, so looking sooner would find nothing new; a pod that
# leaves sooner is skipped by its channel's health check in the meantime.
RESOLVE_INTERVAL_SECONDS = 5.0

_LISTS = ("ipv4:", "ipv6:")
_DNS = "dns:///"


@dataclass(frozen=True)
class Address:
    """One replica: an address that a target names or resolves to."""

    # The replica's name in replica choice, metrics, logs and traces, and what its
    # channel dials: ip:port or [ipv6]:port (or, until its first look-up, a name target
    # itself, which gRPC then resolves inside the channel).
    name: str
    # The name:port a looked-up address was found under: the channel's :authority and
    # the name the server's TLS certificate must carry. None when given as an address.
    authority: str | None = None


@dataclass(frozen=True)
class HostName:
    """A target that names a host, to be looked up."""

    host: str
    port: int

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"


# Looks a host up: the IP addresses it has now; raises OSError (or ValueError, for a
# name IDNA can't encode) when it can't.
Lookup = Callable[[str, int], Awaitable[Sequence[str]]]


async def lookup_ips(host: str, port: int) -> list[str]:
    """The IP addresses `host` has, by getaddrinfo on the loop's executor (it blocks)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _address_name(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_target(target: str) -> tuple[Address, ...] | HostName:
    """The addresses a target gives outright, or the host name it needs looked up."""
    if target.startswith(_LISTS):
        parts = target[len("ipv4:") :].split(",")
        return tuple(Address(_address_name(*_split_host_port(part))) for part in parts)
    host, port = _split_host_port(target.removeprefix(_DNS))
    if _is_ip(host):
        return (Address(_address_name(host, port)),)
    return HostName(host, port)


def _unique(addresses: Sequence[Address]) -> tuple[Address, ...]:
    """In order, each address once (two targets may name the same pod)."""
    seen: dict[str, Address] = {}
    for address in addresses:
        seen.setdefault(address.name, address)
    return tuple(seen.values())


class TargetAddresses:
    """The addresses of a backend's targets, looked up again every interval.

    Until a name's first look-up answers, the name target itself stands for its
    addresses (gRPC resolves it inside one channel), so a new pool serves at once.
    A look-up that fails or finds nothing keeps the addresses found before, as
    gRPC's own resolver does: a DNS outage must not empty a backend.
    """

    def __init__(
        self,
        targets: Sequence[str],
        on_change: Callable[[tuple[Address, ...]], None],
        *,
        lookup: Lookup = lookup_ips,
        interval_seconds: float = RESOLVE_INTERVAL_SECONDS,
    ) -> None:
        if interval_seconds <= 0:
            raise ValueError(f"interval_seconds {interval_seconds} is not above 0")
        self._names: dict[str, HostName] = {}
        self._found: dict[str, tuple[Address, ...]] = {}
        for target in targets:
            parsed = parse_target(target)
            if isinstance(parsed, HostName):
                self._names[target] = parsed
                self._found[target] = (Address(target),)
            else:
                self._found[target] = parsed
        self.addresses = _unique([a for found in self._found.values() for a in found])
        self._on_change = on_change
        self._lookup = lookup
        self._interval = interval_seconds
        self._failing: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def start_looking_up(self) -> None:
        """Look the names up now and every interval after (from within the running loop);
        nothing to do when every target is an address."""
        if self._names and self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._look_up_every_interval(), name="upstream-address-lookup"
            )

    async def _look_up_every_interval(self) -> None:
        while True:
            await self.look_up()
            await asyncio.sleep(self._interval)

    async def look_up(self) -> None:
        """Look every name up once; `on_change` hears of a new set of addresses."""
        for target, name in self._names.items():
            try:
                ips = await self._lookup(name.host, name.port)
            except (OSError, ValueError) as exc:  # ValueError: a name IDNA can't encode
                self._note_failure(target, str(exc))
                continue
            if not ips:
                self._note_failure(target, "no addresses")
                continue
            self._failing.discard(target)
            self._found[target] = tuple(
                Address(_address_name(ip, name.port), name.authority) for ip in sorted(set(ips))
            )
        addresses = _unique([a for found in self._found.values() for a in found])
        if addresses != self.addresses:
            self.addresses = addresses
            self._on_change(addresses)

    def _note_failure(self, target: str, error: str) -> None:
        """Log a look-up failure once per run of them, not every interval."""
        if target not in self._failing:
            self._failing.add(target)
            log.warning(
                "target look-up failed; keeping its addresses",
                extra={"target": target, "error": error},
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
