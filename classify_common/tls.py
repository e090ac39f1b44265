"""TLS for both layers, from PEM files named in the settings.

A server with a certificate and key serves TLS; given a client CA as well it
requires client certificates signed by it (mTLS), which is how capability
servers can admit the orchestrator alone. Clients trust a CA file, and present
their own certificate where the server asks for one.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
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
