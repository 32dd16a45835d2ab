"""TLS material and SuperNode keys: names, chain, real handshakes, key types Flower accepts."""

import ipaddress
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from flwr.cli.supernode.register import try_load_public_key
from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve

from edgefl.deploy import pki
from edgefl.deploy.errors import DeployError

HOSTS = ["192.168.1.20", "edge-server.local"]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> pki.TlsFiles:
    return pki.write_tls(tmp_path_factory.mktemp("pki"), HOSTS)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_server_cert_names_loopback_and_given_hosts(tls: pki.TlsFiles) -> None:
    sans = _cert(tls.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert set(sans.value.get_values_for_type(x509.DNSName)) == {"localhost", "edge-server.local"}
    assert set(sans.value.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address(h) for h in ("127.0.0.1", "::1", "192.168.1.20")
    }


def test_server_cert_chain_verifies_for_named_hosts_only(tls: pki.TlsFiles) -> None:
    ca, server = _cert(tls.ca_cert), _cert(tls.server_cert)
    builder = PolicyBuilder().store(Store([ca]))
    for name in (
        x509.DNSName("localhost"),
        x509.DNSName("edge-server.local"),
        x509.IPAddress(ipaddress.ip_address("192.168.1.20")),
    ):
        chain = builder.build_server_verifier(name).verify(server, [])
        assert chain[-1] == ca
    with pytest.raises(VerificationError):
        builder.build_server_verifier(x509.DNSName("elsewhere.example")).verify(server, [])


def _handshake(tls: pki.TlsFiles, cafile: Path, server_hostname: str) -> bytes:
    """A TLS connection on loopback to a server holding ``tls``'s certificate; its first bytes."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(tls.server_cert, tls.server_key)
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve_one() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.sendall(b"ok")
            except (ssl.SSLError, OSError):
                pass  # the client refused the certificate

        thread = threading.Thread(target=serve_one, daemon=True)
        thread.start()
        client_ctx = ssl.create_default_context(cafile=cafile)
        try:
            with (
                socket.create_connection(listener.getsockname(), timeout=10) as raw,
                client_ctx.wrap_socket(raw, server_hostname=server_hostname) as conn,
            ):
                return conn.recv(2)
        finally:
            thread.join(timeout=10)


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost"])
def test_tls_handshake_over_loopback_with_the_ca(tls: pki.TlsFiles, name: str) -> None:
    assert _handshake(tls, tls.ca_cert, name) == b"ok"


def test_tls_handshake_fails_with_another_ca_or_an_unnamed_host(
    tls: pki.TlsFiles, tmp_path: Path
) -> None:
    other = pki.write_tls(tmp_path)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tls, other.ca_cert, "127.0.0.1")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tls, tls.ca_cert, "10.9.9.9")


def test_node_key_is_p384_openssh_and_flower_accepts_it(tmp_path: Path) -> None:
    files = pki.write_node_key(tmp_path, "node-1")
    private = serialization.load_ssh_private_key(files.private_key.read_bytes(), password=None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert private.curve.name == "secp384r1"
    public_line = files.public_key.read_text()
    assert public_line.startswith("ecdsa-sha2-nistp384 ") and public_line.endswith(" node-1\n")
    public = pki.load_node_public_key(files.public_key)
    assert public.public_numbers() == private.public_key().public_numbers()
    assert uses_nist_ec_curve(public)
    assert try_load_public_key(files.public_key)  # `flwr supernode register` loads it so
    assert pki.load_node_private_key(files.private_key).curve.name == "secp384r1"


def test_private_keys_are_owner_only(tls: pki.TlsFiles, tmp_path: Path) -> None:
    node = pki.write_node_key(tmp_path, "node-1")
    for path in (tls.ca_key, tls.server_key, node.private_key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in (tls.ca_cert, tls.server_cert, node.public_key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_existing_material_is_kept_without_force(tmp_path: Path) -> None:
    first = pki.write_tls(tmp_path)
    before = first.ca_cert.read_bytes()
    with pytest.raises(DeployError, match="--force"):
        pki.write_tls(tmp_path)
    assert first.ca_cert.read_bytes() == before
    pki.write_tls(tmp_path, force=True)
    assert first.ca_cert.read_bytes() != before
    pki.write_node_key(tmp_path, "node-1")
    with pytest.raises(DeployError, match="--force"):
        pki.write_node_key(tmp_path, "node-1")


@pytest.mark.parametrize("host", ["not a host", "-bad.example", "a..b", ""])
def test_malformed_san_is_refused_naming_the_flag(host: str) -> None:
    with pytest.raises(DeployError, match="--san"):
        pki.subject_alt_names([host])


def test_node_key_of_a_type_flower_rejects_is_refused(tmp_path: Path) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    path = tmp_path / "ed25519"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(DeployError, match="ECDSA"):
        pki.load_node_private_key(path)


def test_node_name_must_be_a_plain_file_name(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match="node-1"):
        pki.write_node_key(tmp_path, "../escape")
