"""Graft's Kubernetes client logs in as kubectl does (graft.operator.kubeconfig): a kubeconfig's
context (server, CA, client certificate, token, tokenFile, exec plugin, namespace) or a pod's
service account, against a real TLS server that requires what the kubeconfig says."""
from __future__ import annotations

import base64
import json
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import yaml

from graft.operator.kube import Kube
from graft.operator.kubeconfig import KubeconfigError, load_credentials, service_account
from tests.engine.test_admin_tls import write_pki


class Echo(BaseHTTPRequestHandler):
    """Answers who called: the client certificate's subject and the Authorization header."""

    def do_GET(self):  # noqa: N802 - http.server's name
        cert = self.connection.getpeercert() or {}
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
