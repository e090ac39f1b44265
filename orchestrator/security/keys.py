"""API keys, stored hashed, each naming a tenant and a role.

The keys file (YAML) holds only SHA-256 hashes of the keys, never the keys:

    keys:
      - id: laptop            # a label for logs; never the key itself
        sha256: 9f86d0...     # python -m orchestrator.security new-key prints both
        tenant: local         # a string: quote a name YAML reads otherwise ("00123")
        role: user            # user or admin
    tenants:                  # optional rate limits, token bucket per tenant
      local: {rate_per_second: 50, burst: 100}   # a tenant some key names
    default_tenant_limit: {rate_per_second: 20, burst: 40}   # optional: every other
                              # tenant a key names, each with a bucket of its own

Keys are long random tokens, so one unsalted SHA-256 is enough to keep a
leaked file from revealing them. A presented key is looked up by its hash, in
one step however many keys the file holds (a loop of constant-time comparisons
cost 1.5 ms a call at 10,000 keys). The lookup's timing depends only on the
presented key's hash, which a caller cannot steer towards a stored one, so it
tells nothing about the stored keys. The file is read within
classify_common.documents' bounds (size, depth, no YAML aliases).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from classify_common.documents import DocumentRefused
from classify_common.fields import FieldRefused, Fields, read_yaml, type_name
from orchestrator.security.limits import TokenBucketSettings

ROLES = ("user", "admin")
# The keys file's limit for each tenant that `tenants` does not list.
DEFAULT_TENANT_LIMIT = "default_tenant_limit"
KEY_PREFIX = "ck_"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_EMPTY_KEY_DIGEST = hashlib.sha256(b"").hexdigest()

log = logging.getLogger(__name__)


class KeysFileError(ValueError):
    """The keys file is malformed; the message names the entry."""


@dataclass(frozen=True)
class Caller:
    key_id: str
    tenant: str
    role: str


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKeys:
    callers_by_hash: Mapping[str, Caller]
    tenant_limits: Mapping[str, TokenBucketSettings]

    def identify(self, key: str) -> Caller | None:
        return self.callers_by_hash.get(hash_key(key))


def load_api_keys(path: Path) -> ApiKeys:
    try:
        return read_yaml(path, _api_keys)
    except OSError as exc:
        raise KeysFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except (DocumentRefused, FieldRefused) as exc:  # already names the file (and line)
        raise KeysFileError(str(exc)) from exc


def _api_keys(document: Any) -> ApiKeys:
    if not isinstance(document, dict) or set(document) - {
        "keys",
        "tenants",
        DEFAULT_TENANT_LIMIT,
    }:
        raise FieldRefused(
            "",
            f"expected a mapping with `keys` and optional `tenants` and `{DEFAULT_TENANT_LIMIT}`",
        )
    top = Fields(document)
    callers: dict[str, Caller] = {}
    first_entry: dict[str, int] = {}
    first_with_id: dict[str, int] = {}
    for index, entry in enumerate(top.items("keys")):
        fields = Fields(entry, top.path(f"keys[{index}]"))
        digest, caller = _caller(fields)
        if digest in callers:
            # Which tenant and role would the key have? Neither entry may decide silently.
            raise FieldRefused(
                fields.path("sha256"), f"the same key as keys[{first_entry[digest]}]"
            )
        if caller.key_id in first_with_id:
            # Access logs and refusals name a caller by its key's id: two keys of one id
            # (of other tenants or roles, even) could not be told apart afterwards.
            raise FieldRefused(
                fields.path("id"), f"the same id as keys[{first_with_id[caller.key_id]}]"
            )
        callers[digest], first_entry[digest] = caller, index
        first_with_id[caller.key_id] = index
    tenants = top.mapping("tenants")
    limits = {tenant: _tenant_limit(tenants, tenant) for tenant in _tenant_names(tenants)}
    with_keys = {caller.tenant for caller in callers.values()}
    if DEFAULT_TENANT_LIMIT in document:
        # Every tenant is known here, by its keys: each unlisted one gets a bucket of
        # its own of this size, not one bucket shared by all of them.
        default = _tenant_limit(top, DEFAULT_TENANT_LIMIT)
        for tenant in sorted(with_keys):
            limits.setdefault(tenant, default)
    for tenant in limits:
        if tenant not in with_keys:
            # A misspelt name leaves the tenant it meant without its limit. Not refused:
            # a tenant whose last key was just revoked keeps its limit line, and a
            # refused file would stop every orchestrator that restarts.
            log.warning(
                "a tenant limit names no key's tenant; is it misspelt?",
                extra={"where": tenants.path(tenant), "tenant": tenant},
            )
    return ApiKeys(callers, limits)


def _tenant_names(tenants: Fields) -> list[str]:
    """The tenant names under `tenants`, each refused unless YAML read it as a string
    (see _caller)."""
    names: list[str] = []
    for name in tenants.raw_keys():
        if isinstance(name, bool):
            # Its path would be `tenants.True`, which names no line: the file says `on`.
            raise FieldRefused(tenants.where, _not_a_tenant_name(name))
        if not isinstance(name, str):
            raise FieldRefused(tenants.path(name), _not_a_tenant_name(name))
        names.append(name)
    return names


def _not_a_tenant_name(value: object) -> str:
    spelt = " (yes, no, on, off, true or false, unquoted)" if isinstance(value, bool) else ""
    return (
        f"YAML reads a tenant name as the {type_name(value)} {value!r}{spelt}, not a string; "
        "quote it"
    )


def quoted_tenant(tenant: str) -> str:
    """`tenant` as a keys file must spell it: a YAML string, whatever it holds."""
    # Not ASCII-escaped: YAML takes no JSON surrogate pair (an emoji) in a string.
    return json.dumps(tenant, ensure_ascii=False)


def _caller(entry: Fields) -> tuple[str, Caller]:
    """(the key's hash, who it belongs to) from one entry of `keys`."""
    digest = entry.string("sha256")
    if not _HEX64.fullmatch(digest):
        raise FieldRefused(entry.path("sha256"), "not 64 lower-case hex digits")
    if digest == _EMPTY_KEY_DIGEST:
        # A template whose key variable was empty: it would let `Bearer ` in.
        raise FieldRefused(entry.path("sha256"), "the hash of an empty key")
    # A label: any scalar, as YAML reads it.
    key_id = str(entry.raw("id"))
    # A name, matched against the names under `tenants`, and what keeps tenants'
    # results, cache entries and rate apart: only a string, as written. Unquoted,
    # `00123` and `83` are both the int 83 to YAML (an octal, a decimal), and were
    # once one tenant; `on` became 'True' and an empty value 'None'.
    tenant = entry.raw("tenant")
    if not isinstance(tenant, str):
        raise FieldRefused(entry.path("tenant"), _not_a_tenant_name(tenant))
    role = entry.choice("role", ROLES)
    entry.refuse_unknown()
    return digest, Caller(key_id, tenant, role)


def _tenant_limit(tenants: Fields, tenant: str) -> TokenBucketSettings:
    spec = Fields(tenants.raw(tenant), tenants.path(tenant))
    rate, burst = spec.number("rate_per_second"), spec.integer("burst")
    spec.refuse_unknown()
    try:
        return TokenBucketSettings(rate, burst)
    except ValueError as exc:
        raise FieldRefused(tenants.path(tenant), str(exc)) from exc
