"""TLS and mutual TLS for every gRPC port and channel, with certificates reloaded from disk.

Servers (services/runtime.py) serve TLS on their gRPC port when tls.enabled: the
credentials are grpc's dynamic server credentials, whose fetch function runs at each
new TLS handshake and re-reads the certificate, key and CA files when one of them
changed on disk (mtime, size or inode). A replacement takes effect for the next
connection, no restart; a replacement that does not parse, or whose key does not match
its certificate (a half-written rotation), is logged and the previous files stay in use
until the next handshake finds a good pair. Connections already open keep the
certificate they were made with.

Clients (the SDK, the CLI and a server calling another server) build their channel
credentials from `ChannelTls`: the CA that signs the servers, and with mTLS a client
certificate and key; a server uses its own certificate as its client certificate. Their
files are re-read when they change too (checked at most once a second); callers that
cache channels compare `generation` and open new channels when it moved.

`atomlog up --tls` makes a local CA and certificates with `LocalCa` (the `cryptography`
package).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("atomlog.tls")

CLIENT_AUTH = ("none", "require")
RELOAD_CHECK_INTERVAL_S = 1.0  # clients: how often they look whether their files changed


class TlsFileError(ValueError):
    """A certificate, key or CA file is missing or unusable (a full sentence)."""


# ------------------------------------------------------------------------- checking files
def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise TlsFileError(f"cannot read {what} {path}: {error.strerror or error}") from None


def _certificates(data: bytes, path: str, what: str) -> list:
    from cryptography import x509

    try:
        found = x509.load_pem_x509_certificates(data)
    except ValueError as error:
        raise TlsFileError(f"{what} {path} is not a PEM certificate: {error}") from None
    if not found:
        raise TlsFileError(f"{what} {path} holds no PEM certificate")
    return found


def check_pair(cert: bytes, key: bytes, cert_path: str = "certificate",
               key_path: str = "key") -> None:
    """Raise TlsFileError unless `cert` is PEM certificate(s) and `key` the PEM private key
    of the first one."""
    from cryptography.hazmat.primitives import serialization

    leaf = _certificates(cert, cert_path, "certificate file")[0]
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as error:
        raise TlsFileError(f"key file {key_path} is not an unencrypted PEM private key: "
                           f"{error}") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if (private.public_key().public_bytes(serialization.Encoding.PEM, public)
            != leaf.public_key().public_bytes(serialization.Encoding.PEM, public)):
        raise TlsFileError(f"key file {key_path} is not the private key of certificate "
                           f"{cert_path}")


def check_files(cert_file: str = "", key_file: str = "", ca_file: str = "") -> None:
    """Read and parse the files that are given; raise TlsFileError naming the first
    problem."""
    if ca_file:
        _certificates(_read(ca_file, "CA file"), ca_file, "CA file")
    if cert_file or key_file:
        if not (cert_file and key_file):
            raise TlsFileError("a certificate needs its key and a key its certificate")
        check_pair(_read(cert_file, "certificate file"), _read(key_file, "key file"),
                   cert_file, key_file)


def file_signature(path: str) -> tuple | None:
    """What tells a changed file (mtime, size, inode: a rename over it too); None when it
    is missing."""
    try:
        s = os.stat(path)
    except OSError:
        return None
    return s.st_mtime_ns, s.st_size, s.st_ino


class _Files:
    """The contents of some files, re-read when their stat signature changes."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self._signature: tuple | None = None
        self.contents: list[bytes] = []

    def _stat(self) -> tuple:
        return tuple(file_signature(path) for path in self.paths)

    def changed(self) -> tuple | None:
        """The new signature when the files differ from the last accepted read, else None."""
        signature = self._stat()
        return signature if signature != self._signature else None

    def accept(self, signature: tuple, contents: list[bytes]) -> None:
        self._signature, self.contents = signature, contents

    def read(self) -> list[bytes]:
        return [Path(p).read_bytes() for p in self.paths]


# ------------------------------------------------------------------------- servers
class ServerTls:
    """The gRPC server credentials of a process: its certificate and key, the CA its
    clients' certificates must chain to, and whether clients must present one."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str = "",
                 require_client_cert: bool = False):
        if require_client_cert and not ca_file:
            raise TlsFileError("client certificates can only be required with a CA file")
        check_files(cert_file, key_file, ca_file)
        self.require_client_cert = require_client_cert
        self._files = _Files([cert_file, key_file] + ([ca_file] if ca_file else []))
        self._lock = threading.Lock()
        self.reloads = 0
        self._refused: tuple | None = None
        self._grpc_generation = 0
        signature = self._files.changed()
        self._files.accept(signature, self._files.read())

    def _configuration(self, contents: list[bytes]):
        cert, key, *ca = contents
        return grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=ca[0] if ca else None)

    def credentials(self) -> grpc.ServerCredentials:
        self._grpc_generation = self.generation
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(self._files.contents), self._fetch,
            require_client_authentication=self.require_client_cert)

    @property
    def generation(self) -> int:
        return self.reloads

    def reload_if_changed(self) -> None:
        """Re-read the files if they changed and are good (then `generation` grows);
        keep the current ones otherwise. Never raises."""
        try:
            with self._lock:
                signature = self._files.changed()
                if signature is None:
                    return
                try:
                    contents = self._files.read()
                    cert, key, *ca = contents
                    check_pair(cert, key, self._files.paths[0], self._files.paths[1])
                    if ca:
                        _certificates(ca[0], self._files.paths[2], "CA file")
                except (OSError, TlsFileError) as error:
                    # Half-way through a rotation, or a bad file: keep what works, look again
                    # at the next handshake (logged once per change of the files).
                    if signature != self._refused:
                        self._refused = signature
                        log.warning("TLS files changed but cannot be used yet; serving the "
                                    "previous certificate: %s", error)
                    return
                self._files.accept(signature, contents)
                self.reloads += 1
            log.info("TLS certificate reloaded from %s", self._files.paths[0])
        except Exception:  # noqa: BLE001 — never fail a handshake from here
            log.exception("TLS reload check failed")

    def _fetch(self):
        """grpc calls this at each new handshake: a new configuration when the files
        changed (and are good) since grpc was last given one, else None (keep it)."""
        self.reload_if_changed()
        with self._lock:
            if self._grpc_generation == self.generation:
                return None
            self._grpc_generation = self.generation
            contents = self._files.contents
        try:
            return self._configuration(contents)
        except Exception:  # noqa: BLE001
            log.exception("TLS configuration failed")
            return None

    def ssl_context(self):
        """An ssl.SSLContext for a plain TLS server (HTTPS /metrics, a partition server's
        link) that switches to the current files at each handshake, as the gRPC port does,
        and asks clients for a certificate as the gRPC port does."""
        import ssl

        state = {"generation": -1, "context": None}

        def current() -> ssl.SSLContext:
            self.reload_if_changed()
            with self._lock:
                generation, paths = self.generation, list(self._files.paths)
            if state["generation"] != generation:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.load_cert_chain(paths[0], paths[1])
                if len(paths) > 2:
                    context.load_verify_locations(paths[2])
                context.verify_mode = (ssl.CERT_REQUIRED if self.require_client_cert
                                       else ssl.CERT_NONE)
                context.sni_callback = switch
                state.update(generation=generation, context=context)
            return state["context"]

        def switch(sock, _server_name, context) -> None:
            try:
                fresh = current()
            except (OSError, ssl.SSLError):
                log.exception("cannot load the reloaded TLS files for /metrics")
                return None
            if fresh is not context:
                sock.context = fresh
            return None

        return current()


# ------------------------------------------------------------------------- clients
@dataclass(frozen=True)
class TlsConfig:
    """What a client needs to reach a TLS cluster: the CA file that signs the servers'
    certificates and, for mTLS (tls.client_auth=require), a client certificate and key.
    `server_name`: the name to check the servers' certificates against instead of the
    host of each address (when servers are reached through addresses their certificates
    do not carry)."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def check(self) -> None:
        if not self.ca_file:
            raise TlsFileError("TLS needs a CA file (the CA that signed the servers)")
        check_files(self.cert_file, self.key_file, self.ca_file)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


class ChannelTls:
    """Channel credentials from a TlsConfig, rebuilt when its files change on disk.
    Thread-safe."""

    def __init__(self, config: TlsConfig, check_interval_s: float = RELOAD_CHECK_INTERVAL_S):
        config.check()
        self.config = config
        self._files = _Files([config.ca_file]
                             + ([config.cert_file, config.key_file] if config.cert_file else []))
        self._interval = check_interval_s
        self._lock = threading.Lock()
        self._checked_at = time.monotonic()
        self.generation = 0
        self._credentials = self._build(self._files.changed())
        self._ssl_lock = threading.Lock()
        self._ssl: tuple | None = None  # (generation, ssl.SSLContext) for plain TLS sockets

    def _build(self, signature: tuple) -> grpc.ChannelCredentials:
        contents = self._files.read()
        ca, *pair = contents
        if pair:
            check_pair(pair[0], pair[1], self.config.cert_file, self.config.key_file)
        _certificates(ca, self.config.ca_file, "CA file")
        self._files.accept(signature, contents)
        return grpc.ssl_channel_credentials(ca, pair[1] if pair else None,
                                            pair[0] if pair else None)

    def current(self) -> tuple[int, grpc.ChannelCredentials]:
        """(generation, credentials): the generation grows when the files were reloaded."""
        now = time.monotonic()
        if now - self._checked_at < self._interval:
            return self.generation, self._credentials
        with self._lock:
            if now - self._checked_at >= self._interval:
                self._checked_at = now
                signature = self._files.changed()
                if signature is not None:
                    try:
                        self._credentials = self._build(signature)
                        self.generation += 1
                        log.info("client TLS files reloaded (%s)", self.config.ca_file)
                    except (OSError, TlsFileError) as error:
                        log.warning("client TLS files changed but cannot be used yet; "
                                    "keeping the previous ones: %s", error)
            return self.generation, self._credentials

    @property
    def options(self) -> list[tuple[str, str]]:
        return self.config.channel_options()

    def ssl_context(self):
        """An ssl.SSLContext for a plain TLS socket to a server (the partition servers'
        links, partition_server/copy_link.py) with what the channels' credentials hold: the
        CA that signs the servers (their certificates and host names checked) and, for
        mTLS, the client certificate. Rebuilt when the files were reloaded; if the new ones
        cannot be loaded (a rotation half-way), the previous context stays in use."""
        import ssl

        generation, _ = self.current()
        with self._ssl_lock:
            if self._ssl is not None and self._ssl[0] == generation:
                return self._ssl[1]
            try:
                context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                                     cafile=self.config.ca_file)
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                if self.config.cert_file:
                    context.load_cert_chain(self.config.cert_file, self.config.key_file)
            except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
                if self._ssl is None:
                    raise
                log.warning("client TLS files cannot be loaded for links yet; keeping the "
                            "previous ones: %s", error)
                return self._ssl[1]
            self._ssl = (generation, context)
            return context

    def server_hostname(self, address: str) -> str:
        """The name a server reached at `address` (host:port) must carry in its
        certificate: `server_name` when set, else the address's host."""
        return self.config.server_name or address.rpartition(":")[0].strip("[]")

    def channel(self, address: str, options: list | None = None) -> grpc.Channel:
        """A blocking channel to `address`."""
        return grpc.secure_channel(address, self.current()[1],
                                   options=[*(options or []), *self.options])

    def aio_channel(self, address: str, options: list | None = None,
                    interceptors: list | None = None) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(address, self.current()[1],
                                       options=[*(options or []), *self.options],
                                       interceptors=interceptors or None)


def channel(address: str, tls: "ChannelTls | None", options: list | None = None) -> grpc.Channel:
    """A blocking channel: TLS when `tls` is given, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return tls.channel(address, options)


# ------------------------------------------------------------------------- a local CA
class LocalCa:
    """A certificate authority in a directory (ca.crt, ca.key), for local clusters and
    tests: certificates for servers (serverAuth and clientAuth, as servers call each other
    with their own) and clients."""

    def __init__(self, directory: Path, name: str = "atomlog local CA"):
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        self.directory = Path(directory)
        self.ca_file = self.directory / "ca.crt"
        key_file = self.directory / "ca.key"
        if self.ca_file.exists() and key_file.exists():
            self._cert = x509.load_pem_x509_certificate(self.ca_file.read_bytes())
            self._key = serialization.load_pem_private_key(key_file.read_bytes(), None)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._key = _new_key()
        subject = _name(name)
        now = _now()
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                   .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=3650))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(
                       digital_signature=True, key_cert_sign=True, crl_sign=True,
                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                       key_agreement=False, encipher_only=False, decipher_only=False),
                       critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                       self._key.public_key()), critical=False))
        self._cert = builder.sign(self._key, _sha256())
        _write_private(key_file, _key_pem(self._key))
        _write_atomically(self.ca_file, self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cert_file: Path, key_file: Path, common_name: str,
              hosts: list[str] = (), server: bool = True, days: int = 825) -> int:
        """Write a certificate (SANs: `hosts`, DNS names or IP addresses) and its key; the
        key first, then the certificate, each replaced atomically. Returns the serial."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.x509.oid import ExtendedKeyUsageOID

        key = _new_key()
        now = _now()
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + [
            ExtendedKeyUsageOID.CLIENT_AUTH]
        serial = x509.random_serial_number()
        builder = (x509.CertificateBuilder().subject_name(_name(common_name))
                   .issuer_name(self._cert.subject).public_key(key.public_key())
                   .serial_number(serial)
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                       self._key.public_key()), critical=False))
        names = []
        for host in dict.fromkeys(hosts):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, _sha256())
        Path(cert_file).parent.mkdir(parents=True, exist_ok=True)
        _write_private(Path(key_file), _key_pem(key))
        _write_atomically(Path(cert_file), cert.public_bytes(serialization.Encoding.PEM))
        return serial


def certificate_serial(pem: bytes) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem).serial_number


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "atomlog"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sha256():
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _write_private(path: Path, data: bytes) -> None:
    _write_atomically(path, data, 0o600)
