"""Authentication (issue 24, item 2): who is calling, established once per call.

auth.mode picks where a call's principal comes from:
- none: nobody is asked (the default; every call's principal is "anonymous").
- mtls: the client certificate (tls.client_auth=require): its subject CN, or with
  auth.mtls_principal=san_dns / san_uri the first DNS / URI subject alternative name.
- token: a bearer token in the `authorization` metadata (`Bearer <token>`): a signed JWT
  (auth.jwt_key_file: RS256/384/512, ES256/384 or EdDSA public key; auth.jwt_secret_file:
  HS256/384/512 secret) whose iss, aud, exp and nbf are checked, principal `sub`; or a
  static token of auth.static_tokens_file (lines `principal token`), compared in constant
  time. Both files are re-read when they change on disk.
- mtls_or_token: a bearer token when the call carries one, else the client certificate.

Health and reflection calls are never asked (probes, grpcurl's listing). Every refusal
is UNAUTHENTICATED with ErrorInfo reason UNAUTHENTICATED and metadata `failure` (why:
missing_credentials, expired, wrong_issuer, ...), logged (never with the token) and
counted in atomlog_authentication_failures_total{reason}. Servicers find the caller in
`current()` (a contextvar set for the call).

Principals in auth.service_principals (exact names, or prefixes ending in `*`) are
servers: `Principal.service`. A server's own calls to other servers carry its
certificate (mTLS) or the token of auth.service_token_file (`TokenSource`).

Clients (the SDK, the CLI, servers) attach a token with `bearer_channel` (blocking
channels) or `aio_interceptors` (grpc.aio channels).
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
import hmac
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.logs import event
from services.tls import file_signature

log = logging.getLogger("atomlog.auth")

MODES = ("none", "mtls", "token", "mtls_or_token")
MTLS_PRINCIPAL_RULES = ("cn", "san_dns", "san_uri")
RELOAD_CHECK_INTERVAL_S = 1.0
# Calls that never need credentials: health probes and reflection (listing services).
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                   "/grpc.reflection.v1.ServerReflection/")
ANONYMOUS = "anonymous"
_PUBLIC_KEY_ALGORITHMS = {"rsa": ["RS256", "RS384", "RS512"], "P-256": ["ES256"],
                          "P-384": ["ES384"], "ed25519": ["EdDSA"]}
_SECRET_ALGORITHMS = ["HS256", "HS384", "HS512"]
MIN_SECRET_BYTES = 32


@dataclass(frozen=True)
class Principal:
    name: str
    mechanism: str  # none | mtls | jwt | static
    service: bool = False


NOBODY = Principal(ANONYMOUS, "none")  # every call's principal with auth.mode=none
# The caller of a call between two roles of one process (services/local.py LocalStub).
IN_PROCESS = Principal("in-process", "local", service=True)

_CURRENT: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "atomlog_principal", default=None)


def current() -> Principal | None:
    """The principal of the call being served (None outside a call, or in-process)."""
    return _CURRENT.get()


def set_current(principal: Principal | None) -> contextvars.Token:
    return _CURRENT.set(principal)


def reset_current(token: contextvars.Token) -> None:
    _CURRENT.reset(token)


class AuthFailure(Exception):
    """A call is refused: `failure` is the short reason (the metric's label)."""

    def __init__(self, failure: str, message: str):
        super().__init__(message)
        self.failure = failure
        self.message = message


class AuthFileError(ValueError):
    """A token, key or secret file is missing or unusable (a full sentence)."""


# ------------------------------------------------------------------ files re-read on change
_KEEP = object()


class WatchedFile:
    """A file parsed by `parse`, re-parsed when its mtime, size or inode changes (looked at
    at most once a second). A changed file that does not parse is logged and the previous
    contents stay in use. Thread-safe."""

    def __init__(self, path: str, parse, what: str,
                 check_interval_s: float = RELOAD_CHECK_INTERVAL_S, when_deleted=_KEEP):
        """`when_deleted`: the value while the file is gone (default: keep the last)."""
        self.path, self._parse, self.what = path, parse, what
        self._when_deleted = when_deleted
        self._interval = check_interval_s
        self._lock = threading.Lock()
        self._signature = self._stat()
        self.value = parse(self._read())  # raises AuthFileError: the caller reports it
        self._checked_at = time.monotonic()

    def _stat(self) -> tuple | None:
        return file_signature(self.path)

    def _read(self) -> bytes:
        try:
            return Path(self.path).read_bytes()
        except OSError as error:
            raise AuthFileError(f"cannot read {self.what} {self.path}: "
                                f"{error.strerror or error}") from None

    def get(self):
        now = time.monotonic()
        if now - self._checked_at < self._interval:
            return self.value
        with self._lock:
            if now - self._checked_at >= self._interval:
                self._checked_at = now
                signature = self._stat()
                if (signature is None and self._signature is not None
                        and self._when_deleted is not _KEEP):
                    self.value, self._signature = self._when_deleted, None
                    event(log, "deleted: none of its entries is valid any more",
                          logging.WARNING, what=self.what, path=self.path)
                elif signature is not None and signature != self._signature:
                    try:
                        self.value = self._parse(self._read())
                        self._signature = signature
                        event(log, "reloaded", what=self.what, path=self.path)
                    except AuthFileError as error:
                        event(log, "changed but unusable; keeping the previous contents",
                              logging.WARNING, what=self.what, error=str(error))
            return self.value


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def parse_static_tokens(data: bytes, path: str = "static tokens file") -> list[tuple[bytes, str]]:
    """Lines `principal token` (blank lines and `#` comments skipped) → [(sha256 of the
    token, principal)]. A token listed twice is refused."""
    entries: list[tuple[bytes, str]] = []
    seen: set[bytes] = set()
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise AuthFileError(f"{path} line {number}: expected `principal token`")
        principal, token = fields
        if len(token) < 16:
            raise AuthFileError(f"{path} line {number}: the token of {principal!r} is shorter "
                                f"than 16 characters")
        digest = _digest(token)
        if digest in seen:
            raise AuthFileError(f"{path} line {number}: a token listed twice")
        seen.add(digest)
        entries.append((digest, principal))
    return entries


def parse_public_key(data: bytes, path: str = "JWT key file"):
    """A PEM public key (or certificate) → (key, the JWT algorithms it verifies)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    try:
        if b"BEGIN CERTIFICATE" in data:
            key = x509.load_pem_x509_certificate(data).public_key()
        else:
            key = serialization.load_pem_public_key(data)
    except ValueError as error:
        raise AuthFileError(f"{path} is not a PEM public key or certificate: {error}") from None
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < 2048:
            raise AuthFileError(f"{path}: an RSA key of {key.key_size} bits (2048 at least)")
        return key, _PUBLIC_KEY_ALGORITHMS["rsa"]
    if isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name in ("secp256r1", "secp384r1"):
        return key, _PUBLIC_KEY_ALGORITHMS["P-256" if key.curve.name == "secp256r1" else "P-384"]
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key, _PUBLIC_KEY_ALGORITHMS["ed25519"]
    raise AuthFileError(f"{path}: unsupported key type (RSA, EC P-256/P-384 or Ed25519)")


def parse_secret(data: bytes, path: str = "JWT secret file") -> bytes:
    secret = data.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthFileError(f"{path}: an HS256 secret needs at least {MIN_SECRET_BYTES} bytes, "
                            f"it has {len(secret)}")
    return secret


def parse_token(data: bytes, path: str = "token file") -> str:
    token = data.decode("utf-8", "replace").strip()
    if not token or any(c.isspace() for c in token):
        raise AuthFileError(f"{path} must hold one token (no spaces), it holds "
                            f"{'nothing' if not token else 'several words'}")
    return token


# ------------------------------------------------------------------ the server side
def _matches(name: str, patterns: list[str]) -> bool:
    return any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


class Authenticator:
    """Establishes the principal of a call from its metadata and TLS peer (see the module
    doc). Built from a Config; raises AuthFileError for unusable files."""

    def __init__(self, mode: str = "none", *, mtls_principal: str = "cn",
                 jwt_issuer: str = "", jwt_audience: str = "", jwt_key_file: str = "",
                 jwt_secret_file: str = "", jwt_leeway_s: float = 30.0,
                 static_tokens_file: str = "", service_principals: list[str] = ()):
        if mode not in MODES:
            raise ValueError(f"auth mode {mode!r} is not one of {list(MODES)}")
        self.mode = mode
        self.mtls_principal = mtls_principal
        self.jwt_issuer, self.jwt_audience, self.jwt_leeway_s = jwt_issuer, jwt_audience, jwt_leeway_s
        self.service_principals = list(service_principals)
        self._public_key = (WatchedFile(jwt_key_file, lambda d: parse_public_key(d, jwt_key_file),
                                        "auth.jwt_key_file") if jwt_key_file else None)
        self._secret = (WatchedFile(jwt_secret_file, lambda d: parse_secret(d, jwt_secret_file),
                                    "auth.jwt_secret_file") if jwt_secret_file else None)
        # Deleting the tokens file revokes every token in it (fails closed).
        self._static = (WatchedFile(static_tokens_file,
                                    lambda d: parse_static_tokens(d, static_tokens_file),
                                    "auth.static_tokens_file", when_deleted=[])
                        if static_tokens_file else None)
        # Principals logged once each (bounded), so the log says who called without a
        # line per call.
        self._seen: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    @classmethod
    def from_config(cls, config) -> "Authenticator":
        return cls(config["auth.mode"], mtls_principal=config["auth.mtls_principal"],
                   jwt_issuer=config["auth.jwt_issuer"], jwt_audience=config["auth.jwt_audience"],
                   jwt_key_file=config["auth.jwt_key_file"],
                   jwt_secret_file=config["auth.jwt_secret_file"],
                   jwt_leeway_s=config["auth.jwt_leeway_ms"] / 1000,
                   static_tokens_file=config["auth.static_tokens_file"],
                   service_principals=split_list(config["auth.service_principals"]))

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def principal(self, name: str, mechanism: str) -> Principal:
        return Principal(name, mechanism, _matches(name, self.service_principals))

    def authenticate(self, metadata, auth_context: dict) -> Principal:
        """The caller of a call with `metadata` (invocation metadata) and `auth_context`
        (the TLS peer's properties); raises AuthFailure."""
        if self.mode == "none":
            return NOBODY
        header = None
        for key, value in metadata or ():
            if key == "authorization":
                header = value if isinstance(value, str) else value.decode("latin-1")
                break
        if self.mode in ("token", "mtls_or_token") and header is not None:
            return self._from_token(header)
        if self.mode in ("mtls", "mtls_or_token"):
            return self._from_certificate(auth_context or {})
        raise AuthFailure("missing_credentials", "this call carries no bearer token "
                          "(metadata `authorization: Bearer <token>`)")

    def _from_certificate(self, auth_context: dict) -> Principal:
        if not auth_context.get("x509_pem_cert"):
            raise AuthFailure("missing_credentials", "no client certificate")
        if self.mtls_principal == "cn":
            names = [n.decode() for n in auth_context.get("x509_common_name", [])]
        else:
            names = _sans(auth_context["x509_pem_cert"][0], self.mtls_principal)
        if not names or not names[0]:
            raise AuthFailure("no_principal_in_certificate",
                              f"the client certificate has no {self.mtls_principal} "
                              f"(auth.mtls_principal)")
        return self.principal(names[0], "mtls")

    def _from_token(self, header: str) -> Principal:
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthFailure("malformed_authorization",
                              "the authorization metadata is not `Bearer <token>`")
        if self._static is not None:
            presented, found = _digest(token), None
            for digest, principal in self._static.get():  # every entry: constant time
                if hmac.compare_digest(presented, digest) and found is None:
                    found = principal
            if found is not None:
                return self.principal(found, "static")
        if (self._public_key is None and self._secret is None) or token.count(".") != 2:
            raise AuthFailure("unknown_token", "the bearer token is not known")
        return self.principal(self._verify_jwt(token), "jwt")

    def _verify_jwt(self, token: str) -> str:
        import jwt

        try:
            algorithm = jwt.get_unverified_header(token).get("alg", "")
        except jwt.InvalidTokenError as error:  # (DecodeError, or a header PyJWT refuses)
            raise AuthFailure("malformed_token", f"the bearer token is not a JWT: "
                              f"{error}") from None
        key = None
        if self._public_key is not None and algorithm in self._public_key.get()[1]:
            key = self._public_key.get()[0]
        elif self._secret is not None and algorithm in _SECRET_ALGORITHMS:
            key = self._secret.get()
        if key is None:
            raise AuthFailure("bad_algorithm", f"a JWT signed with {algorithm or 'no algorithm'!r},"
                              f" which no configured key verifies")
        try:
            claims = jwt.decode(token, key, algorithms=[algorithm], issuer=self.jwt_issuer,
                                audience=self.jwt_audience, leeway=self.jwt_leeway_s,
                                options={"require": ["exp", "iss", "aud", "sub"]})
        except jwt.ExpiredSignatureError:
            raise AuthFailure("expired", "the JWT has expired") from None
        except jwt.ImmatureSignatureError:
            raise AuthFailure("not_yet_valid", "the JWT is not valid yet (nbf/iat)") from None
        except jwt.InvalidIssuerError:
            raise AuthFailure("wrong_issuer", "the JWT's issuer is not auth.jwt_issuer") from None
        except jwt.InvalidAudienceError:
            raise AuthFailure("wrong_audience",
                              "the JWT's audience does not include auth.jwt_audience") from None
        except jwt.InvalidSignatureError:
            raise AuthFailure("bad_signature", "the JWT's signature does not verify") from None
        except jwt.MissingRequiredClaimError as error:
            raise AuthFailure("missing_claim", f"the JWT lacks the {error.claim!r} claim") from None
        except jwt.InvalidTokenError as error:
            raise AuthFailure("invalid_token", f"the JWT is invalid: {error}") from None
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject:
            raise AuthFailure("missing_claim", "the JWT's sub is empty")
        return subject

    def note(self, principal: Principal, peer: str) -> None:
        """Log a principal the first time it is seen (bounded memory)."""
        key = (principal.name, principal.mechanism)
        if key in self._seen:
            self._seen.move_to_end(key)
            return
        self._seen[key] = None
        if len(self._seen) > 10_000:
            self._seen.popitem(last=False)
        event(log, "principal authenticated", principal=principal.name,
              mechanism=principal.mechanism, service=principal.service, peer=peer)


def _sans(pem: bytes, rule: str) -> list[str]:
    from cryptography import x509

    try:
        certificate = x509.load_pem_x509_certificate(pem)
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return []
    kind = x509.DNSName if rule == "san_dns" else x509.UniformResourceIdentifier
    return list(names.get_values_for_type(kind))


def split_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def record_failure(failure: AuthFailure, method: str, peer: str) -> None:
    # Imported here: clients import this module too (TokenSource), and services.metrics
    # brings prometheus_client and http.server into every SDK process (Spark's Python
    # workers among them) for a server-side counter.
    from services import metrics

    metrics.AUTH_FAILURES.labels(failure.failure).inc()
    event(log, "authentication failed", logging.WARNING, method=method, peer=peer,
          failure=failure.failure, error=failure.message)


# ------------------------------------------------------------------ the client side
class TokenSource:
    """The bearer token a client sends: given, or read from a file (re-read when the file
    changes, looked at at most once a second)."""

    def __init__(self, token: str | None = None, token_file: str | None = None):
        if (token is None) == (token_file is None):
            raise ValueError("give a token or a token file, not both")
        if token is not None:
            self._file = None
            self._token = parse_token(token.encode(), "the token")
        else:
            self._file = WatchedFile(token_file, lambda d: parse_token(d, token_file),
                                     "token file")

    @property
    def token(self) -> str:
        return self._token if self._file is None else self._file.get()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)


def _with_token(details, source: TokenSource):
    return _Details(details.method, details.timeout,
                    [*(details.metadata or ()), *source.metadata()], details.credentials,
                    getattr(details, "wait_for_ready", None), getattr(details, "compression", None))


class _Details(collections.namedtuple("_Details", ["method", "timeout", "metadata", "credentials",
                                                    "wait_for_ready", "compression"]),
               grpc.ClientCallDetails):
    pass


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, source: TokenSource):
        self.source = source

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_token(details, self.source), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_token(details, self.source), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(_with_token(details, self.source), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(_with_token(details, self.source), requests)


def bearer_channel(channel: grpc.Channel, source: TokenSource | None) -> grpc.Channel:
    """`channel` sending `source`'s token on every call (unchanged when None)."""
    return channel if source is None else grpc.intercept_channel(channel, _Bearer(source))


class _AioBearer(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, source: TokenSource):
        self.source = source

    async def intercept_unary_unary(self, continuation, details, request):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self.source.metadata())
        return await continuation(grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready), request)


def aio_interceptors(source: TokenSource | None) -> list:
    """Interceptors for a grpc.aio channel that send `source`'s token (atomlog's RPCs are
    all unary)."""
    return [] if source is None else [_AioBearer(source)]
