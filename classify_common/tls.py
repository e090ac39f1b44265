"""TLS for both layers, from PEM files named in the settings.

A server with a certificate and key serves TLS; given a client CA as well it
requires client certificates signed by it (mTLS), which is how capability
servers can admit the orchestrator alone. Clients trust a CA file, and present
their own certificate where the server asks for one.
"""

from __future__ import annotations

import base64
import binascii
import re
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc

from classify_common.settings import SettingsError, file_problem


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SettingsError(f"cannot read {path}: {exc.strerror}") from exc


@dataclass(frozen=True)
class ServerTls:
    cert_file: Path
    key_file: Path
    # When set, clients must present a certificate signed by this CA (mTLS).
    client_ca_file: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.client_ca_file) if self.client_ca_file else None,
            require_client_auth=self.client_ca_file is not None,
        )


@dataclass(frozen=True)
class ClientTls:
    ca_file: Path
    # The client's own certificate and key, for servers that require mTLS.
    cert_file: Path | None = None
    key_file: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file) if self.key_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None,
        )


def server_tls(
    cert: Path | None, key: Path | None, client_ca: Path | None, flags: str
) -> ServerTls | None:
    """Server TLS from the three settings, or None for plaintext; `flags` names them."""
    if cert is None and key is None:
        if client_ca is not None:
            raise SettingsError(f"{flags}: a client CA needs a certificate and key too")
        return None
    if cert is None or key is None:
        raise SettingsError(f"{flags}: give both the certificate and the key")
    _check_pair(cert, key, flags)
    if client_ca is not None:
        check_ca_file(client_ca, flags)
    return ServerTls(cert, key, client_ca)


def client_tls(
    ca: Path | None, cert: Path | None, key: Path | None, flags: str
) -> ClientTls | None:
    """Client TLS from the three settings, or None for plaintext; `flags` names them."""
    if ca is None:
        if cert is not None or key is not None:
            raise SettingsError(f"{flags}: a client certificate needs the CA file too")
        return None
    if (cert is None) != (key is None):
        raise SettingsError(f"{flags}: give both the client certificate and its key")
    check_ca_file(ca, flags)
    if cert is not None and key is not None:
        _check_pair(cert, key, flags)
    return ClientTls(ca, cert, key)


# The files are checked when the settings are: gRPC itself said only "Invalid cert
# chain file" on its own stderr, and the server's refusal read as a port in use; a CA
# file of garbage was taken, and every call to the backends failed its handshake.


def _check_pair(cert: Path, key: Path, flags: str) -> None:
    """Refuse a certificate and key that are not PEM, or not a pair."""
    _check_file(cert, flags)
    _check_file(key, flags)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # What gRPC serves, not what this OpenSSL's default policy likes (RSA-1024 and
    # SHA-1 certificates were refused here and served by gRPC).
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    try:
        # No password: an encrypted key (which gRPC cannot use) is refused rather than
        # prompted for on the terminal.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except OSError as exc:  # ssl.SSLError is an OSError too
        reason = getattr(exc, "reason", None) or exc.strerror or str(exc)
        raise SettingsError(
            f"{flags}: {cert} and {key} are not a PEM certificate and its key ({reason})"
        ) from exc
    _check_dates(cert, flags)


def _check_dates(cert: Path, flags: str) -> None:
    """Refuse a certificate outside its validity period. OpenSSL loads one (and gRPC
    serves it) whatever its dates, and every peer then failed the handshake: the server
    started and said SERVING, and each call was UNAVAILABLE. Peers check the dates
    without leeway, so this does too."""
    validity = _validity(cert)
    if validity is None:
        return
    not_before, not_after = validity
    now = datetime.now(UTC)
    period = f"valid from {_spoken(not_before)} to {_spoken(not_after)}"
    if now > not_after:
        raise SettingsError(f"{flags}: {cert} has expired: it was {period}")
    if now < not_before:
        raise SettingsError(f"{flags}: {cert} is not valid yet: it is {period}")


def _spoken(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


# The first certificate of a PEM file: the one OpenSSL serves (the rest is its chain).
_PEM_CERTIFICATE = re.compile(
    r"-----BEGIN (?:TRUSTED |X509 )?CERTIFICATE-----(.*?)-----END ", re.DOTALL
)


def _validity(cert: Path) -> tuple[datetime, datetime] | None:
    """notBefore and notAfter (UTC) of the certificate OpenSSL serves from `cert`, read
    from its DER (RFC 5280: Certificate, then TBSCertificate's version, serial number,
    signature, issuer and validity), or None where they cannot be read here. The
    standard library has no public reader of a certificate's dates, and `cryptography`
    is no dependency; the file has passed OpenSSL's load, which is the judge of its form."""
    match = _PEM_CERTIFICATE.search(_read(cert).decode("ascii", "replace"))
    if match is None:
        return None
    try:
        der = base64.b64decode("".join(match[1].split()), validate=True)
        _, start, _ = _element(der, 0, _SEQUENCE)  # Certificate
        _, at, _ = _element(der, start, _SEQUENCE)  # TBSCertificate
        tag, _, end = _element(der, at)
        if tag == _EXPLICIT_VERSION:
            at = end
        for _field in ("serialNumber", "signature", "issuer"):
            at = _element(der, at)[2]
        _, at, _ = _element(der, at, _SEQUENCE)  # Validity
        not_before, at = _time(der, at)
        not_after, _ = _time(der, at)
    except (ValueError, IndexError, binascii.Error):
        return None
    return not_before, not_after


_SEQUENCE = 0x30
_EXPLICIT_VERSION = 0xA0
_UTC_TIME = 0x17
_GENERALIZED_TIME = 0x18


def _element(der: bytes, at: int, expected: int | None = None) -> tuple[int, int, int]:
    """(tag, start, end) of the content of the DER element at `at`."""
    tag, length = der[at], der[at + 1]
    start = at + 2
    if length & 0x80:
        count = length & 0x7F
        length = int.from_bytes(der[start : start + count], "big")
        start += count
    end = start + length
    if end > len(der) or (expected is not None and tag != expected):
        raise ValueError("not the DER of a certificate")
    return tag, start, end


def _time(der: bytes, at: int) -> tuple[datetime, int]:
    """A certificate's Time at `at` (RFC 5280 4.1.2.5: UTCTime YYMMDDHHMMSSZ, years 1950
    to 2049, else GeneralizedTime YYYYMMDDHHMMSSZ), and where the next element starts."""
    tag, start, end = _element(der, at)
    text = der[start:end].decode("ascii")
    if tag == _UTC_TIME:
        moment = datetime.strptime(text, "%y%m%d%H%M%SZ")
        # strptime's %y puts 69..99 in the 1900s; RFC 5280 puts 50..99 there.
        century = 1900 if int(text[:2]) >= 50 else 2000
        moment = moment.replace(year=century + moment.year % 100)
    elif tag == _GENERALIZED_TIME:
        moment = datetime.strptime(text, "%Y%m%d%H%M%SZ")
    else:
        raise ValueError("not a certificate's Time")
    return moment.replace(tzinfo=UTC), end


def check_ca_file(ca: Path, flags: str) -> None:
    """Refuse a CA file that holds no PEM certificate; `flags` names its setting."""
    _check_file(ca, flags)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    try:
        context.load_verify_locations(cafile=ca)
    except OSError as exc:
        reason = getattr(exc, "reason", None) or exc.strerror or str(exc)
        raise SettingsError(f"{flags}: {ca} holds no PEM CA certificate ({reason})") from exc


def _check_file(path: Path, flags: str) -> None:
    """Refuse anything but a regular file before OpenSSL opens it: a named pipe's
    opening waited for a writer, forever, and held the start."""
    if problem := file_problem(path):
        raise SettingsError(f"{flags}: {problem}")
