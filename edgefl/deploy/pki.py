"""Make and load TLS material (a CA, the SuperLink's certificate) and SuperNode key pairs.

NOTE [deploy material]: one folder holds everything, laid out as Flower's flags expect it:
``ca.crt`` (copied to every device: SuperNodes verify the SuperLink with it), ``ca.key`` (stays
with whoever issues certificates), ``server.pem`` + ``server.key`` (the SuperLink's certificate,
whose subject alternative names must list every name and address devices dial), and
``nodes/<name>`` + ``nodes/<name>.pub`` (a SuperNode's key pair: ECDSA P-384 in OpenSSH format,
the key type Flower's node authentication accepts; the private key goes to that device only,
the public key is registered at the SuperLink). Private keys are written with mode 0600.
"""

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from edgefl.deploy.errors import DeployError

CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
NODES_DIR = "nodes"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
NODE_CURVE = ec.SECP384R1()  # Flower's `flwr supernode register` recommends P-384
_TLS_CURVE = ec.SECP256R1()
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True)
class MaterialFile:
    """One file of the deploy material: where it lies, what it is for, whether it is private."""

    path: Path
    purpose: str
    private: bool  # a private key: written with mode 0600, never leaves its holder


@dataclass(frozen=True)
class TlsFiles:
    """Where the CA and the SuperLink's certificate and key lie (see NOTE [deploy material])."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> "TlsFiles":
        """The TLS files of the deploy folder ``directory``."""
        d = Path(directory)
        return cls(d / CA_CERT, d / CA_KEY, d / SERVER_CERT, d / SERVER_KEY)

    def listing(self) -> list[MaterialFile]:
        """Every file, each with its purpose (NOTE [deploy material])."""
        return [
            MaterialFile(self.ca_cert, "CA certificate: copy it to every device", False),
            MaterialFile(self.ca_key, "the CA's: keep it where certificates are issued", True),
            MaterialFile(self.server_cert, "the SuperLink's certificate", False),
            MaterialFile(self.server_key, "the SuperLink's: keep it on the server", True),
        ]


@dataclass(frozen=True)
class NodeKeyFiles:
    """A SuperNode's key pair: the private key (OpenSSH PEM) and the public key (one line)."""

    private_key: Path
    public_key: Path

    @classmethod
    def in_dir(cls, directory: Path, name: str) -> "NodeKeyFiles":
        """The key pair of node ``name`` in the deploy folder ``directory``."""
        private = Path(directory) / NODES_DIR / name
        return cls(private, private.with_name(f"{name}.pub"))

    def listing(self) -> list[MaterialFile]:
        """Both files, the public key first (NOTE [deploy material])."""
        name = self.private_key.name
        return [
            MaterialFile(self.public_key, f"{name}'s public key: register it", False),
            MaterialFile(self.private_key, f"{name}'s: copy it to that device only", True),
        ]


def write_tls(
    directory: Path, hosts: Sequence[str] = (), *, force: bool = False, valid_days: int = 825
) -> TlsFiles:
    """Create a CA and a SuperLink certificate for ``hosts`` plus loopback; return the paths."""
    files = TlsFiles.in_dir(directory)
    _refuse_overwrite([files.ca_cert, files.ca_key, files.server_cert, files.server_key], force)
    sans = subject_alt_names([*LOOPBACK_HOSTS, *hosts])
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(_TLS_CURVE)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgefl deployment CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now, 3650)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(_TLS_CURVE)
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _common_name(hosts))])
    server_cert = (
        _builder(server_name, ca_name, server_key.public_key(), now, valid_days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    Path(directory).mkdir(parents=True, exist_ok=True)
    _write_public(files.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.ca_key, _pkcs8(ca_key))
    _write_public(files.server_cert, server_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.server_key, _pkcs8(server_key))
    return files


def write_node_key(directory: Path, name: str, *, force: bool = False) -> NodeKeyFiles:
    """Create the key pair of SuperNode ``name`` under ``directory``/nodes; return the paths."""
    if not _NAME.match(name):
        raise DeployError(
            f"node name {name!r} is not usable as a file name; use letters, digits, '.', '_' "
            "or '-', e.g. node-1"
        )
    files = NodeKeyFiles.in_dir(directory, name)
    _refuse_overwrite([files.private_key, files.public_key], force)
    key = ec.generate_private_key(NODE_CURVE)
    files.private_key.parent.mkdir(parents=True, exist_ok=True)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),  # a SuperNode starts unattended: no passphrase prompt
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write_private(files.private_key, private)
    _write_public(files.public_key, public + f" {name}\n".encode())
    return files


def subject_alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """DNS or IP entries for ``hosts`` (duplicates dropped); a malformed host raises."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        entry = _san(host.strip())
        if entry not in names:
            names.append(entry)
    return names


def load_node_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """The SuperNode private key at ``path``, checked to be one Flower accepts."""
    data = _read(path, "SuperNode private key", "create one with: edgefl keys NAME")
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except (ValueError, UnsupportedAlgorithm, TypeError) as exc:
        raise DeployError(
            f"{path} is not an unencrypted OpenSSH private key ({exc}); create a key pair with: "
            "edgefl keys NAME"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise DeployError(
            f"{path} holds a {type(key).__name__}; Flower authenticates SuperNodes with ECDSA "
            "(NIST curve) keys only: create one with: edgefl keys NAME"
        )
    return key


def load_node_public_key(path: Path) -> ec.EllipticCurvePublicKey:
    """The SuperNode public key at ``path`` (OpenSSH line), checked to be one Flower accepts."""
    data = _read(path, "SuperNode public key", "create a key pair with: edgefl keys NAME")
    try:
        key = serialization.load_ssh_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise DeployError(
            f"{path} is not an OpenSSH public key ({exc}); register the .pub file that "
            "edgefl keys wrote"
        ) from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise DeployError(
            f"{path} holds a {type(key).__name__}; Flower accepts ECDSA (NIST curve) node keys "
            "only: create one with: edgefl keys NAME"
        )
    return key


def load_certificate(
    path: Path, what: str, fix: str = "create the TLS material with: edgefl certs"
) -> x509.Certificate:
    """The PEM certificate at ``path``; a missing or malformed file raises naming ``what``."""
    data = _read(path, what, fix)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise DeployError(f"{what} {path} is not a PEM certificate; {fix}") from None


def check_tls_files(files: TlsFiles) -> None:
    """Check that the SuperLink's certificate, key and CA exist and parse; raise with the fix."""
    load_certificate(files.ca_cert, "CA certificate")
    load_certificate(files.server_cert, "SuperLink certificate")
    data = _read(files.server_key, "SuperLink TLS key", "create it with: edgefl certs")
    try:
        serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise DeployError(
            f"{files.server_key} is not an unencrypted PEM private key; recreate the TLS "
            "material with: edgefl certs --force"
        ) from None


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or len(host) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
        raise DeployError(
            f"{host!r} is neither an IP address nor a DNS name; pass the SuperLink's address as "
            "devices dial it, e.g. --san 192.168.1.20 or --san edge-server.local"
        )
    return x509.DNSName(host.rstrip(".").lower())


def _common_name(hosts: Sequence[str]) -> str:
    return hosts[0] if hosts else "localhost"


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
    days: int,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # devices' clocks drift
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not cert_sign,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _pkcs8(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),  # the SuperLink reads it unattended
    )


def _refuse_overwrite(paths: Sequence[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise DeployError(
            f"{', '.join(existing)} already exist; pass --force to replace them (devices "
            "holding the old files then need the new ones)"
        )


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a fresh file that only its owner can read (mode 0600)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


def _write_public(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o644)


def _read(path: Path, what: str, fix: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except FileNotFoundError:
        raise DeployError(f"{what} {path} does not exist; {fix}") from None
    except OSError as exc:
        raise DeployError(
            f"{what} {path} cannot be read ({exc.strerror}); check its permissions "
            f"(chmod 600 {path} as the user starting edgefl)"
        ) from None
