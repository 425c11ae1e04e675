"""Graft's Kubernetes client logs in as kubectl does (graft.operator.kubeconfig): a kubeconfig's
context (server, CA, client certificate, token, tokenFile, exec plugin, namespace) or a pod's
service account, against a real TLS server that requires what the kubeconfig says."""
from __future__ import annotations

import asyncio
import base64
import json
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import yaml

from graft.operator.kube import Kube, KubeError
from graft.operator.kubeconfig import KubeconfigError, load_credentials, service_account
from tests.engine.test_admin_tls import write_pki


class Echo(BaseHTTPRequestHandler):
    """Answers who called: the client certificate's subject and the Authorization header."""

    def do_GET(self):  # noqa: N802 - http.server's name
        cert = getattr(self.connection, "getpeercert", dict)() or {}   # plain http has no peer certificate
        subject = dict(x[0] for x in cert.get("subject", ()))
        body = json.dumps({"path": self.path, "cn": subject.get("commonName"),
                           "authorization": self.headers.get("Authorization")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory):
    """An https server for 127.0.0.1 that asks for a client certificate of the `client` CA (optional,
    so that token users get in too) and says who called."""
    root = tmp_path_factory.mktemp("kube-pki")
    ca, cert, key = write_pki(root, "apiserver", ips=["127.0.0.1"])
    client_ca, client_cert, client_key = write_pki(root, "graft-user", dns=["graft-user"])
    other_ca, _, _ = write_pki(root, "other", ips=["127.0.0.1"])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.load_verify_locations(client_ca)
    context.verify_mode = ssl.CERT_OPTIONAL
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"https://127.0.0.1:{server.server_address[1]}", "ca": ca, "root": root, "other_ca": other_ca,
           "client_cert": client_cert, "client_key": client_key}
    server.shutdown()


def b64(path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write(path, config) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def kubeconfig(apiserver, tmp_path, **user) -> dict:
    (tmp_path / "certs").mkdir(exist_ok=True)
    (tmp_path / "certs" / "ca.pem").write_bytes(apiserver["ca"].read_bytes())
    return {"apiVersion": "v1", "kind": "Config", "current-context": "work",
            "clusters": [{"name": "prod", "cluster": {"server": apiserver["url"],
                                                      "certificate-authority": "certs/ca.pem"}}],
            "users": [{"name": "me", "user": user}],
            "contexts": [{"name": "work", "context": {"cluster": "prod", "user": "me", "namespace": "team-a"}},
                         {"name": "other", "context": {"cluster": "prod", "user": "me"}}]}


async def whoami(creds) -> dict:
    async with Kube.from_credentials(creds) as kube:
        return await kube.get(f"/api/v1/namespaces/{creds.namespace}/pods")


async def test_a_client_certificate_from_the_current_context_over_verified_tls(apiserver, tmp_path):
    path = write(tmp_path / "config", kubeconfig(apiserver, tmp_path, **{
        "client-certificate-data": b64(apiserver["client_cert"]),
        "client-key-data": b64(apiserver["client_key"])}))
    creds = load_credentials(path)
    assert creds.namespace == "team-a" and creds.server == apiserver["url"]
    seen = await whoami(creds)
    assert seen["cn"] == "graft-user" and seen["authorization"] is None
    assert seen["path"] == "/api/v1/namespaces/team-a/pods"
    # the other context: same user, the namespace kubectl defaults to
    assert load_credentials(path, "other").namespace == "default"


async def test_a_token_file_relative_to_the_kubeconfig_and_an_exec_plugin(apiserver, tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    creds = load_credentials(write(tmp_path / "config", kubeconfig(apiserver, tmp_path, tokenFile="token")))
    assert (await whoami(creds))["authorization"] == "Bearer s3cret"
    plugin = tmp_path / "plugin.py"
    plugin.write_text("import json, os\nassert json.loads(os.environ['KUBERNETES_EXEC_INFO'])['kind'] == "
                      "'ExecCredential'\nprint(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', "
                      "'kind': 'ExecCredential', 'status': {'token': os.environ['WHO']}}))\n")
    creds = load_credentials(write(tmp_path / "config", kubeconfig(apiserver, tmp_path, exec={
        "apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable, "args": [str(plugin)],
        "env": [{"name": "WHO", "value": "from-exec"}]})))
    assert (await whoami(creds))["authorization"] == "Bearer from-exec"


async def test_a_server_the_ca_does_not_vouch_for_is_refused(apiserver, tmp_path):
    config = kubeconfig(apiserver, tmp_path, token="t")
    config["clusters"][0]["cluster"] = {"server": apiserver["url"],
                                        "certificate-authority-data": b64(apiserver["other_ca"])}
    creds = load_credentials(write(tmp_path / "config", config))
    with pytest.raises(httpx.ConnectError, match="certificate verify failed"):
        await whoami(creds)
    # insecure-skip-tls-verify, said in so many words, gets in
    config["clusters"][0]["cluster"]["insecure-skip-tls-verify"] = True
    assert (await whoami(load_credentials(write(tmp_path / "config", config))))["authorization"] == "Bearer t"


def test_what_cannot_be_loaded_is_said_naming_the_entry(apiserver, tmp_path, monkeypatch):
    path = write(tmp_path / "config", kubeconfig(apiserver, tmp_path, token="t"))
    with pytest.raises(KubeconfigError, match="no context named 'nope'"):
        load_credentials(path, "nope")
    with pytest.raises(KubeconfigError, match="cannot read kubeconfig .*missing: No such file"):
        load_credentials(tmp_path / "missing")
    config = kubeconfig(apiserver, tmp_path, **{"client-certificate-data": b64(apiserver["client_cert"])})
    with pytest.raises(KubeconfigError, match="without its key"):
        load_credentials(write(tmp_path / "half", config))
    # $KUBECONFIG: several files, the first to name an entry wins
    first = write(tmp_path / "first", {"current-context": "work", "contexts": [], "clusters": [], "users": []})
    monkeypatch.setenv("KUBECONFIG", f"{first}:{path}")
    assert load_credentials().namespace == "team-a"


def test_a_pods_service_account(tmp_path, monkeypatch):
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "namespace").write_text("graft-system\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    creds = service_account(tmp_path)
    assert (creds.server, creds.token, creds.namespace) == ("https://10.96.0.1:443", "sa-token", "graft-system")
    assert creds.headers() == {"Authorization": "Bearer sa-token"}


# ---- credentials that age: read again before they expire, and once after a 401 ----

PLUGIN = """import json, os, pathlib, time
counter = pathlib.Path(os.environ['COUNTER'])
n = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(n))
status = {'token': f'token-{n}'}
ttl = float(os.environ.get('TTL', '0'))
if ttl:
    status['expirationTimestamp'] = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(time.time() + ttl))
print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential', 'status': status}))
"""


class Gate(Echo):
    """Echo, but only for the token the test says is valid: any other is 401, as an API server
    answers an expired token."""

    valid: str | None = None

    def do_GET(self):  # noqa: N802
        if Gate.valid is not None and self.headers.get("Authorization") != f"Bearer {Gate.valid}":
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            body = json.dumps({"kind": "Status", "code": 401, "reason": "Unauthorized",
                               "message": "Unauthorized"}).encode()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()


@pytest.fixture
def gate(apiserver):
    """The same TLS server's twin for tokens: a plain http server with the gate."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Gate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    Gate.valid = None
    server.shutdown()


def exec_config(url: str, tmp_path, ttl: float) -> str:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    return write(tmp_path / "config", {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable, "args": [str(plugin)],
            "env": [{"name": "COUNTER", "value": str(tmp_path / "n")}, {"name": "TTL", "value": str(ttl)}]}}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]})


async def test_an_exec_token_is_fetched_again_before_it_expires(gate, tmp_path):
    from graft.operator.kubeconfig import EXPIRY_MARGIN
    creds = load_credentials(exec_config(gate, tmp_path, ttl=EXPIRY_MARGIN + 2))
    assert creds.token == "token-1" and creds.expires_at is not None
    async with Kube.from_credentials(creds) as kube:
        assert (await kube.get("/api"))["authorization"] == "Bearer token-1"
        assert (await kube.get("/api"))["authorization"] == "Bearer token-1"   # not yet: asked once
        await asyncio.sleep(2.5)
        assert (await kube.get("/api"))["authorization"] == "Bearer token-2"
    assert (tmp_path / "n").read_text() == "2"


async def test_a_401_fetches_the_token_again_once_and_a_literal_token_s_401_stands(gate, tmp_path):
    creds = load_credentials(exec_config(gate, tmp_path, ttl=0))   # a plugin that gives no expiry
    assert creds.token == "token-1" and creds.expires_at is None
    async with Kube.from_credentials(creds) as kube:
        assert (await kube.get("/api"))["authorization"] == "Bearer token-1"
        Gate.valid = "token-2"            # the API server stopped taking token-1
        assert (await kube.get("/api"))["authorization"] == "Bearer token-2"
        Gate.valid = "never"
        with pytest.raises(KubeError) as refused:  # fetched once more (token-3), still refused: the 401 stands
            await kube.get("/api")
        assert refused.value.status == 401
    assert (tmp_path / "n").read_text() == "3"
    literal = write(tmp_path / "literal", {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": gate}}],
        "users": [{"name": "u", "user": {"token": "fixed"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]})
    async with Kube.from_credentials(load_credentials(literal)) as kube:
        with pytest.raises(KubeError) as refused:
            await kube.get("/api")
        assert refused.value.status == 401


async def test_a_service_account_token_rotated_by_the_kubelet_is_read_again(apiserver, tmp_path, monkeypatch):
    import graft.operator.kubeconfig as kubeconfig_module
    monkeypatch.setattr(kubeconfig_module, "FILE_TOKEN_RELOAD", 0.0)   # read again at every call
    (tmp_path / "token").write_text("first\n")
    (tmp_path / "ca.crt").write_bytes(apiserver["ca"].read_bytes())
    (tmp_path / "namespace").write_text("graft-system\n")
    host, port = apiserver["url"].removeprefix("https://").split(":")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    async with Kube.from_credentials(service_account(tmp_path)) as kube:
        assert (await kube.get("/api"))["authorization"] == "Bearer first"
        (tmp_path / "token").write_text("rotated\n")
        assert (await kube.get("/api"))["authorization"] == "Bearer rotated"


def test_the_operator_s_login_expires_with_its_token(gate, tmp_path):
    """kopf logs in again when the ConnectionInfo expires: the operator's login carries the expiry."""
    from graft.operator.kubeconfig import EXPIRY_MARGIN
    from graft.operator.runtime import _from_kubeconfig
    info = _from_kubeconfig(exec_config(gate, tmp_path, ttl=3600), None)
    assert info.token == "token-1" and info.expiration is not None
    left = info.expiration.timestamp() - time.time()
    assert 3600 - EXPIRY_MARGIN - 5 < left <= 3600 - EXPIRY_MARGIN


async def test_a_new_token_from_kopf_s_login_keeps_the_operator_s_client_and_its_watches(gate, tmp_path):
    import kopf

    from graft.operator.runtime import Runtime
    from graft.operator.settings import OperatorSettings
    runtime = Runtime(OperatorSettings())
    try:
        await runtime.connect(kopf.ConnectionInfo(server=gate, token="one", scheme="Bearer"))
        kube = runtime.kube
        assert (await kube.get("/api"))["authorization"] == "Bearer one"
        await runtime.connect(kopf.ConnectionInfo(server=gate, token="two", scheme="Bearer"))
        assert runtime.kube is kube and (await kube.get("/api"))["authorization"] == "Bearer two"
        await runtime.connect(kopf.ConnectionInfo(server=gate + "/", token="two", scheme="Bearer"))
        assert runtime.kube is not kube        # another server: another client
    finally:
        await runtime.close()
