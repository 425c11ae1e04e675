"""How the operator logs in to a rollout's Prometheus besides a bearer token: basic auth, OAuth2
client credentials (one token for many queries, a new one before it expires and after a 401) and a
client certificate (mTLS), each against a real server on 127.0.0.1 that requires it."""
from __future__ import annotations

import asyncio
import base64
import json
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import pytest

from graft.operator.problems import PrometheusRefused, SecretError
from graft.operator.prometheus import HTTP, TRANSPORT, OAuth2Login, PrometheusProvider, ProviderError
from graft.operator.runtime import Runtime
from graft.operator.settings import OperatorSettings
from graft.rollout.spec import OAuth2Source, PrometheusSource, SpecError, parse_spec
from tests.engine.test_admin_tls import write_pki

ANSWER = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                    "result": [{"metric": {}, "value": [0, "0.5"]}]}}).encode()


class Server:
    """One HTTP(S) server on 127.0.0.1: Prometheus' query endpoint, letting in only the
    Authorization it is told, and an OAuth2 token endpoint issuing token-1, token-2, ..."""

    def __init__(self, context: ssl.SSLContext | None = None):
        self.authorization: str | None = None       # what /api/v1/query lets in (None: anyone)
        self.client = ("graft", "s3cret")
        self.expires_in = 3600
        self.tokens: list[str] = []
        self.token_bodies: list[dict] = []
        self.queries = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                outer.queries += 1
                if outer.authorization is not None and self.headers.get("Authorization") != outer.authorization:
                    return self.reply(401, b'{"status": "error", "error": "unauthorized"}')
                self.reply(200, ANSWER)

            def do_POST(self):  # noqa: N802
                form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
                outer.token_bodies.append(form)
                user = "Basic " + base64.b64encode(":".join(outer.client).encode()).decode()
                if self.headers.get("Authorization") != user or form.get("grant_type") != ["client_credentials"]:
                    return self.reply(401, b'{"error": "invalid_client"}')
                outer.tokens.append(f"token-{len(outer.tokens) + 1}")
                outer.authorization = f"Bearer {outer.tokens[-1]}"
                self.reply(200, json.dumps({"access_token": outer.tokens[-1], "token_type": "Bearer",
                                            "expires_in": outer.expires_in}).encode())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if context is not None:
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"{'https' if context else 'http'}://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


class Secrets:
    """The API server's Secrets of the rollout's namespace, as the runtime reads them."""

    def __init__(self, **data: dict[str, str]):
        self.data = data
        self.gets: list[str] = []

    async def get(self, path: str):
        self.gets.append(path)
        name = path.rsplit("/", 1)[1]
        if name not in self.data:
            return None
        return {"data": {k: base64.b64encode(v.encode()).decode() for k, v in self.data[name].items()}}

    async def aclose(self):
        pass


def runtime(server: Server, kube: Secrets, namespaces=("team-a",)) -> Runtime:
    rt = Runtime(OperatorSettings(prometheus_secret_namespaces=list(namespaces),
                                  prometheus_allowed=[server.url]))
    rt.kube = kube
    return rt


async def test_basic_auth_with_the_password_from_a_secret(server):
    server.authorization = "Basic " + base64.b64encode(b"graft:pa55").decode()
    rt = runtime(server, Secrets(prom={"password": "pa55\n"}))
    try:
        source = PrometheusSource(server.url, basic_auth=("graft", ("prom", "password")))
        assert await (await rt.provider(source, "team-a")).query("up") == 0.5
        wrong = runtime(server, Secrets(prom={"password": "guess"}))
        with pytest.raises(ProviderError) as refused:
            await (await wrong.provider(source, "team-a")).query("up")
        assert refused.value.kind == HTTP and "refused the credentials (HTTP 401)" in str(refused.value)
        await wrong.close()
        with pytest.raises(SecretError, match="basicAuth.passwordSecret"):
            await runtime(server, Secrets()).provider(source, "team-a")
    finally:
        await rt.close()


async def test_oauth2_one_token_for_many_queries_a_new_one_before_expiry_and_after_a_401(server):
    provider = PrometheusProvider(server.url, oauth2=OAuth2Login(f"{server.url}/token", "graft", "s3cret",
                                                                 ("metrics.read", "metrics.list")))
    try:
        answers = await asyncio.gather(*(provider.query("up") for _ in range(20)))
        assert answers == [0.5] * 20 and server.tokens == ["token-1"], "twenty queries, one token request"
        assert server.token_bodies[0]["scope"] == ["metrics.read metrics.list"]
        server.authorization = "Bearer revoked"         # the server stops taking token-1
        assert await provider.query("up") == 0.5
        assert server.tokens == ["token-1", "token-2"], "a 401 asks for a token once more"
        server.expires_in = 2                           # kept for half its life when that is short
        server.authorization = None
        provider.oauth2.expires = 0.0
        await provider.query("up")
        assert server.tokens[-1] == "token-3"
        await provider.query("up")
        assert len(server.tokens) == 3
        await asyncio.sleep(1.2)
        await provider.query("up")
        assert len(server.tokens) == 4, "an expired token is replaced before it is sent"
    finally:
        await provider.aclose()


async def test_a_refused_client_is_an_error_naming_the_token_endpoint(server):
    provider = PrometheusProvider(server.url, oauth2=OAuth2Login(f"{server.url}/token", "graft", "wrong"))
    try:
        with pytest.raises(ProviderError) as refused:
            await provider.query("up")
        assert refused.value.kind == HTTP and not refused.value.outage
        assert f"the OAuth2 token endpoint {server.url}/token gave no access token (invalid_client)" in str(
            refused.value)
        assert server.queries == 0, "no query went out without a token"
    finally:
        await provider.aclose()


async def test_a_token_url_outside_the_allow_list_reads_no_secret(server):
    rt = runtime(server, Secrets(idp={"secret": "s3cret"}))
    source = PrometheusSource(server.url, oauth2=OAuth2Source("https://idp.elsewhere/token", "graft", ("idp", "secret")))
    with pytest.raises(PrometheusRefused) as refused:
        await rt.provider(source, "team-a")
    assert refused.value.problem.reason == "PrometheusNotAllowed"
    assert "oauth2.tokenUrl: https://idp.elsewhere/token" in refused.value.problem.message
    assert rt.kube.gets == []
    other = runtime(server, Secrets(idp={"secret": "s3cret"}), namespaces=())
    source = PrometheusSource(server.url, oauth2=OAuth2Source(f"{server.url}/token", "graft", ("idp", "secret")))
    with pytest.raises(PrometheusRefused, match="oauth2.clientSecretSecret"):
        await other.provider(source, "team-a")
    assert other.kube.gets == []


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("prom-pki")
    ca, cert, key = write_pki(root, "prometheus", ips=["127.0.0.1"])
    client_ca, client_cert, client_key = write_pki(root, "graft-operator", dns=["graft-operator"])
    return {"ca": ca, "cert": cert, "key": key, "client_ca": client_ca, "client_cert": client_cert,
            "client_key": client_key}


async def test_mtls_the_client_certificate_from_secrets_is_presented_and_required(pki):
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki["cert"], pki["key"])
    context.load_verify_locations(pki["client_ca"])
    context.verify_mode = ssl.CERT_REQUIRED
    server = Server(context)
    secrets = Secrets(prom={"ca.crt": pki["ca"].read_text()},
                      client={"tls.crt": pki["client_cert"].read_text(), "tls.key": pki["client_key"].read_text()})
    rt = runtime(server, secrets)
    try:
        without = await rt.provider(PrometheusSource(server.url, ca_secret=("prom", "ca.crt")), "team-a")
        with pytest.raises(ProviderError) as refused:
            await without.query("up")
        # refused in the handshake (TLS 1.2) or just after it (TLS 1.3): a credential problem either way
        assert refused.value.kind in (HTTP, TRANSPORT) and "Prometheus at" in str(refused.value)
        source = PrometheusSource(server.url, ca_secret=("prom", "ca.crt"),
                                  client_cert=(("client", "tls.crt"), ("client", "tls.key")))
        assert await (await rt.provider(source, "team-a")).query("up") == 0.5
        # a key that is not the certificate's: the check's error says so, nothing crashes
        secrets.data["client"]["tls.key"] = pki["key"].read_text()
        with pytest.raises(ProviderError, match="client certificate and key do not load"):
            await rt.provider(source, "team-a")
    finally:
        await rt.close()
        server.close()


def test_a_rollout_names_one_login_and_its_fields_are_read():
    base = {"selector": {"matchLabels": {"app": "e"}}, "patch": {"name": "p", "version": "1"}}
    with pytest.raises(SpecError, match="at most one of bearerTokenSecret, basicAuth and oauth2"):
        parse_spec({**base, "analysis": {"prometheus": {
            "bearerTokenSecret": {"name": "t", "key": "k"},
            "oauth2": {"tokenUrl": "https://idp/token", "clientId": "c", "clientSecretSecret": {"name": "c", "key": "k"}}}}})
    spec = parse_spec({**base, "analysis": {"prometheus": {
        "basicAuth": {"username": "graft", "passwordSecret": {"name": "p", "key": "password"}},
        "tls": {"certSecret": {"name": "m", "key": "tls.crt"}, "keySecret": {"name": "m", "key": "tls.key"}}}}})
    source = spec.analysis.prometheus
    assert source.basic_auth == ("graft", ("p", "password"))
    assert source.client_cert == (("m", "tls.crt"), ("m", "tls.key"))
    assert [f for f, _ in source.secrets()] == ["basicAuth.passwordSecret", "tls.certSecret", "tls.keySecret"]
