"""The admin API over TLS, called by the operator's client the way the operator is configured."""
from __future__ import annotations

import datetime
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from graft.operator.admin import AdminClient, AdminError
from graft.operator.settings import OperatorSettings
from graft.rollout.observation import UNREACHABLE
from tests.support import start_engine

pytestmark = pytest.mark.slow
SERVICE = "llm-engine.llm.svc"


def _cert(subject: str, issuer_key, public_key, issuer: str, *, ca: bool, dns: list[str] = (),
          ips: list[str] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if dns or ips:
        names = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_pki(root, name: str, *, dns: list[str] = (), ips: list[str] = ()):
    """A CA (`name`-ca.pem) and a server certificate and key it signed, for `dns` and `ips`."""
    pem = serialization.Encoding.PEM
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert(f"{name} CA", ca_key, ca_key.public_key(), f"{name} CA", ca=True)
    server = _cert(dns[0] if dns else ips[0], ca_key, key.public_key(), f"{name} CA", ca=False, dns=dns, ips=ips)
    (root / f"{name}-ca.pem").write_bytes(ca.public_bytes(pem))
    (root / f"{name}.pem").write_bytes(server.public_bytes(pem))
    (root / f"{name}.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return root / f"{name}-ca.pem", root / f"{name}.pem", root / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, cert, key = write_pki(root, "engine", dns=[SERVICE])       # names the Service, not the pod IP
    other_ca, _, _ = write_pki(root, "other", dns=[SERVICE])
    return {"ca": ca, "cert": cert, "key": key, "other_ca": other_ca}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, pki):
    eng = start_engine(tmp_path_factory.mktemp("tls"), "--admin-tls-cert", str(pki["cert"]),
                       "--admin-tls-key", str(pki["key"]))
    yield eng
    eng.stop()


def client(settings: OperatorSettings, token: str = "test-token") -> AdminClient:
    return AdminClient(token, scheme=settings.admin_scheme, ca_file=settings.admin_ca_file,
                       tls_server_name=settings.admin_tls_server_name, retries=0)


def test_operator_settings_read_the_ca_and_the_server_name():
    s = OperatorSettings.from_env({"GRAFT_ADMIN_CA_FILE": "/etc/graft/ca.pem", "GRAFT_ADMIN_TLS_SERVER_NAME": SERVICE})
    assert (s.admin_scheme, s.admin_ca_file, s.admin_tls_server_name) == ("https", "/etc/graft/ca.pem", SERVICE)
    # no TLS setting at all: refused at start, naming the way out; plain http only when asked for
    with pytest.raises(ValueError, match="GRAFT_ADMIN_PLAIN_HTTP=true to opt out"):
        OperatorSettings.from_env({})
    assert OperatorSettings.from_env({"GRAFT_ADMIN_PLAIN_HTTP": "true"}).admin_scheme == "http"
    assert OperatorSettings.from_env({"GRAFT_ADMIN_SCHEME": "https"}).admin_scheme == "https"
    with pytest.raises(ValueError, match="true or false"):
        OperatorSettings.from_env({"GRAFT_ADMIN_PLAIN_HTTP": "sure"})
    with pytest.raises(ValueError, match="GRAFT_ADMIN_CA_FILE"):
        OperatorSettings.from_env({"GRAFT_ADMIN_CA_FILE": "/ca.pem", "GRAFT_ADMIN_SCHEME": "http"})


async def test_the_operator_calls_the_admin_api_over_verified_tls(engine, pki):
    admin = client(OperatorSettings.from_env({"GRAFT_ADMIN_CA_FILE": str(pki["ca"]),
                                              "GRAFT_ADMIN_TLS_SERVER_NAME": SERVICE}))
    try:
        assert await admin.revision("127.0.0.1", engine.admin_port) == "base"
        assert await admin.apply("127.0.0.1", engine.admin_port, "kv-align", "3.2.1", {"builtin": True}) \
            == "kv-align@3.2.1"
        assert await admin.revert("127.0.0.1", engine.admin_port, "kv-align") == "base"
    finally:
        await admin.aclose()


@pytest.mark.parametrize("env,why", [
    ({"GRAFT_ADMIN_PLAIN_HTTP": "true"}, "plain http to a TLS port"),
    ({"GRAFT_ADMIN_CA_FILE": "other"}, "certificate verify failed: unable to get local issuer"),
    ({"GRAFT_ADMIN_CA_FILE": "ca"}, "IP address mismatch"),
    ({"GRAFT_ADMIN_CA_FILE": "ca", "GRAFT_ADMIN_TLS_SERVER_NAME": "other.llm.svc"}, "Hostname mismatch"),
])
async def test_the_operator_refuses_an_engine_it_cannot_verify(engine, pki, env, why):
    env = {k: str(pki["other_ca"] if v == "other" else pki["ca"]) if k == "GRAFT_ADMIN_CA_FILE" else v
           for k, v in env.items()}
    admin = client(OperatorSettings.from_env(env))
    try:
        with pytest.raises(AdminError) as info:
            await admin.revision("127.0.0.1", engine.admin_port)
        assert info.value.kind == UNREACHABLE
        assert "GRAFT_ADMIN_CA_FILE" not in env or why in info.value.message, info.value.message
    finally:
        await admin.aclose()
