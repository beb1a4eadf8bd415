"""Who is calling: credentials (bearer tokens, mTLS certificates) mapped to client ids and roles.

Configuration (``[server]``)::

    auth_token = "..."              # one shared token: an operator, see below
    [[server.clients]]
    client_id = "trainer-a"
    token = "a-long-random-secret"  # or token_sha256 = "<hex>" to keep the secret out of the file
    roles = []                      # "admin" allows BackendService (and nothing more)
    [[server.clients]]
    client_id = "trainer-b"
    tls_identity = "trainer-b.cluster.local"   # certificate CN or a DNS/URI SAN (mTLS)

A credential listed in ``server.clients`` is *bound* to its ``client_id``: it may open the
session of that client id only, and sees, acknowledges and cancels only the jobs that id
submitted. The old single ``auth_token`` and a server with no credentials at all (the
loopback default) keep their old meaning: an *operator* principal with the admin role that
may act as any client id. That keeps existing single-tenant deployments working; give every
tenant its own entry to keep tenants apart.

Job ids are client-chosen and global, so for a bound principal "does not exist" and "belongs
to someone else" get the same answer, PERMISSION_DENIED, checked before existence (AIP-211):
a tenant cannot probe which job ids others use.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ssl
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from rollout.runtime.types import InvalidArgument
from rollout.server.api import errors
from rollout.server.api.proto_convert import ID_RE

ADMIN = "admin"
_ROLES = {ADMIN}
RPC_PREFIX = "rpc:"
"""Starts the stored client id (delivery channel) of every job submitted with SubmitRollout;
reserved, so no session or credential can take a name the server uses for its own channels."""
RPC_CHANNEL_SEP = "#"
"""Separates the owner in ``SubmitRollout``'s per-job delivery channel ``rpc:<owner>#<job>``;
not in the id charset, so no client id or job id can forge it."""


@dataclass(frozen=True)
class Principal:
    """The authenticated caller of one RPC."""

    client_id: str | None
    """The client id the credential is bound to; None for an operator (any client id)."""
    roles: frozenset[str] = field(default_factory=frozenset)
    source: str = "anonymous"
    """``anonymous`` (no auth configured), ``auth_token``, ``token`` or ``mtls``."""

    @property
    def bound(self) -> bool:
        return self.client_id is not None

    @property
    def admin(self) -> bool:
        return ADMIN in self.roles

    def owns(self, stored_client_id: str) -> bool:
        """Whether a job stored under ``stored_client_id`` is this principal's."""
        return not self.bound or owner_of(stored_client_id) == self.client_id

    def check_client_id(self, client_id: str, field_name: str) -> None:
        if self.bound and client_id != self.client_id:
            raise errors.PermissionDenied(
                f"this credential is bound to client_id {self.client_id!r}; "
                f"{field_name} names another client", "CLIENT_ID_MISMATCH", field_name)

    def denied_job(self, job_id: str) -> errors.PermissionDenied:
        return errors.PermissionDenied(
            f"no job {job_id!r} is visible to client {self.client_id!r} (it does not exist, "
            "or another client submitted it)", "JOB_NOT_ACCESSIBLE", "job_id")

    def rpc_channel(self, job_id: str) -> str:
        """The delivery channel (stored client id) of a job submitted with SubmitRollout."""
        if not self.bound:
            return f"{RPC_PREFIX}{job_id}"
        return f"{RPC_PREFIX}{self.client_id}{RPC_CHANNEL_SEP}{job_id}"


OPERATOR = Principal(None, frozenset({ADMIN}), "anonymous")

current: contextvars.ContextVar[Principal] = contextvars.ContextVar("principal",
                                                                    default=OPERATOR)
"""The current RPC's principal, set by the interceptor (servicers called without it, as in
unit tests, act as the operator)."""


def owner_of(stored_client_id: str) -> str:
    """The client id a stored job belongs to: SubmitRollout's ``rpc:<owner>#<job>`` channel
    unwraps to its owner, and an anonymous caller's ``rpc:<job>`` to "" (no client id)."""
    if not stored_client_id.startswith(RPC_PREFIX):
        return stored_client_id
    owner, sep, _ = stored_client_id[len(RPC_PREFIX):].partition(RPC_CHANNEL_SEP)
    return owner if sep else ""


def identity_of(principal: Principal) -> str:
    """Whose dashboard sessions and live pages count together: a client id, or the operator's
    credential."""
    return principal.client_id if principal.client_id is not None else \
        f"operator:{principal.source}"


def check_not_reserved(client_id: str, field_name: str) -> None:
    """Refuse a client id in the server's own ``rpc:`` namespace (INVALID_ARGUMENT)."""
    if client_id.startswith(RPC_PREFIX):
        raise InvalidArgument(
            f"{field_name} must not start with {RPC_PREFIX!r}: that prefix is reserved for the "
            "server's SubmitRollout delivery channels; choose another client id",
            "RESERVED_CLIENT_ID", field_name)


@dataclass(frozen=True)
class _Entry:
    client_id: str
    roles: frozenset[str]
    token_sha256: bytes | None
    tls_identity: str | None


class Authenticator:
    """Resolves a call's metadata and TLS peer into a :class:`Principal`."""

    def __init__(self, auth_token: str = "", clients: Sequence[Mapping[str, Any]] = ()) -> None:
        self._legacy = hashlib.sha256(auth_token.encode()).digest() if auth_token else None
        self._entries = [_parse_entry(i, c) for i, c in enumerate(clients)]
        self._by_identity = {e.tls_identity: e for e in self._entries if e.tls_identity}
        self.enabled = bool(self._legacy or self._entries)

    def authenticate(self, metadata: Mapping[str, Any],
                     auth_context: Mapping[str, Iterable[bytes]]) -> Principal:
        """The principal of a call; raises Unauthenticated when auth is on and nothing fits."""
        if not self.enabled:
            return OPERATOR
        given = str(metadata.get("authorization", ""))
        if given:
            if not given.startswith("Bearer "):
                raise errors.Unauthenticated("the authorization metadata must be 'Bearer "
                                             "<token>'", "MALFORMED_TOKEN")
            digest = hashlib.sha256(given[len("Bearer "):].encode()).digest()
            # Compare against every entry (no early exit), so timing does not say which
            # prefix of which token matched.
            match: Principal | None = None
            if self._legacy is not None and hmac.compare_digest(digest, self._legacy):
                match = Principal(None, frozenset({ADMIN}), "auth_token")
            for e in self._entries:
                if e.token_sha256 is not None and hmac.compare_digest(digest, e.token_sha256):
                    match = Principal(e.client_id, e.roles, "token")
            if match is None:
                raise errors.Unauthenticated("the bearer token is wrong", "BAD_TOKEN")
            return match
        for identity in peer_identities(auth_context):
            entry = self._by_identity.get(identity)
            if entry is not None:
                return Principal(entry.client_id, entry.roles, "mtls")
        names = peer_identities(auth_context)
        if names:
            raise errors.Unauthenticated(
                f"the client certificate ({', '.join(names[:3])}) is not mapped to a client: "
                "add it as tls_identity of an entry in server.clients", "UNKNOWN_IDENTITY")
        raise errors.Unauthenticated("missing 'authorization: Bearer <token>' metadata (or a "
                                     "client certificate listed in server.clients)",
                                     "MISSING_TOKEN")


def peer_identities(auth_context: Mapping[str, Iterable[bytes]]) -> list[str]:
    """The verified client certificate's CN and subject alternative names (mTLS only: gRPC
    fills these in only for a certificate that chained to ``server.tls_client_ca_file``)."""
    names: list[str] = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth_context.get(key, ()):
            name = value.decode(errors="replace")
            if name not in names:
                names.append(name)
    return names


def _parse_entry(index: int, raw: Mapping[str, Any]) -> _Entry:
    where = f"server.clients[{index}]"

    def bad(msg: str) -> InvalidArgument:
        return InvalidArgument(f"config {where}: {msg}", "BAD_CONFIG", "server.clients")

    if not isinstance(raw, Mapping):
        raise bad("must be a table with client_id and token, token_sha256 or tls_identity")
    unknown = set(raw) - {"client_id", "token", "token_sha256", "tls_identity", "roles"}
    if unknown:
        raise bad(f"unknown keys {sorted(unknown)}")
    client_id = raw.get("client_id")
    if not isinstance(client_id, str) or not ID_RE.fullmatch(client_id):
        raise bad("client_id must be 1-128 characters of letters, digits and ._:/-")
    if client_id.startswith(RPC_PREFIX):
        raise bad(f"client_id must not start with {RPC_PREFIX!r}: that prefix is reserved for "
                  "the server's SubmitRollout delivery channels")
    roles = raw.get("roles", [])
    if not isinstance(roles, list) or not set(roles) <= _ROLES:
        raise bad(f"roles must be a list drawn from {sorted(_ROLES)}")
    token, token_sha = raw.get("token"), raw.get("token_sha256")
    digest: bytes | None = None
    if token is not None:
        if not isinstance(token, str) or len(token) < 16:
            raise bad("token must be a string of at least 16 characters")
        digest = hashlib.sha256(token.encode()).digest()
    elif token_sha is not None:
        try:
            digest = bytes.fromhex(str(token_sha))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise bad("token_sha256 must be 64 hex digits (sha256 of the token)")
    identity = raw.get("tls_identity")
    if identity is not None and (not isinstance(identity, str) or not identity):
        raise bad("tls_identity must be a non-empty string (certificate CN or SAN)")
    if digest is None and identity is None:
        raise bad("give token, token_sha256 or tls_identity")
    return _Entry(client_id, frozenset(roles), digest, identity)


def check_tls_files(cert_file: str, key_file: str, client_ca_file: str = "") -> None:
    """Load the files as OpenSSL will: gRPC itself reports a key that does not match its
    certificate (or a file that is not PEM) only as "Failed to bind" when the port is added,
    which reads like a port in use."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(Path(cert_file).expanduser(), Path(key_file).expanduser())
    except ssl.SSLError as e:
        if "MISMATCH" in (e.reason or ""):  # OpenSSL's KEY_VALUES_MISMATCH
            raise InvalidArgument(
                f"server.tls_key_file {key_file} is not the private key of the certificate "
                f"server.tls_cert_file {cert_file}; give the key the certificate was issued "
                "for", "BAD_CONFIG", "server.tls_key_file") from None
        raise InvalidArgument(
            f"server.tls_cert_file {cert_file} and server.tls_key_file {key_file} are not a "
            f"PEM certificate and its unencrypted PEM private key ({e.reason or e})",
            "BAD_CONFIG", "server.tls_cert_file") from None
    if client_ca_file:
        try:
            ctx.load_verify_locations(cafile=Path(client_ca_file).expanduser())
        except ssl.SSLError as e:
            raise InvalidArgument(
                f"server.tls_client_ca_file {client_ca_file} holds no PEM CA certificate "
                f"({e.reason or e})", "BAD_CONFIG", "server.tls_client_ca_file") from None


def server_credentials(cert_file: str, key_file: str,
                       client_ca_file: str = "") -> grpc.ServerCredentials | None:
    """TLS credentials of the gRPC port (None = plaintext); mTLS when ``client_ca_file`` is set:
    a client must then present a certificate signed by that CA."""
    if not (cert_file or key_file or client_ca_file):
        return None
    if not (cert_file and key_file):
        raise InvalidArgument("TLS needs both server.tls_cert_file and server.tls_key_file "
                              "(server.tls_client_ca_file alone cannot serve TLS)",
                              "BAD_CONFIG", "server.tls_cert_file")

    def read(name: str, path: str) -> bytes:
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as e:
            raise InvalidArgument(f"config {name}: cannot read {path}: {e.strerror}",
                                  "BAD_CONFIG", name) from None

    cert = read("server.tls_cert_file", cert_file)
    key = read("server.tls_key_file", key_file)
    ca = read("server.tls_client_ca_file", client_ca_file) if client_ca_file else None
    check_tls_files(cert_file, key_file, client_ca_file)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)
