"""The Prometheus metrics provider: runs each check's planned queries over HTTP, with timeouts.

Speaks the HTTP API (`/api/v1/query`) directly through httpx, so a rollout's Prometheus may sit
behind auth (a bearer token, basic auth or OAuth2 client credentials, with their secrets from
Secrets; extra headers) and TLS, which is verified (against the system's CAs, or a CA bundle from a
Secret) and may present a client certificate (mTLS). An OAuth2 access token is asked for once and
kept until shortly before its `expires_in`, and asked for again once after a 401.

A query that cannot be answered (Prometheus unreachable, refused, a bad query, a timeout, several
series where one number is needed, an infinite value) makes its check's Measurement carry `error`:
the check's verdict is Error, which holds the rollout; it never promotes it. Unreachable, a timeout
or a 5xx is an outage (`ProviderError.outage`): the rollout holds and goes on by itself once
Prometheus answers, pausing for a person past `outageLimit`; any other error counts towards
`errorLimit`, as a check that cannot be judged will not mend itself. NaN (0/0: a ratio over no requests) reads as no data, like an empty vector.

Which Prometheus a rollout may name is the cluster administrator's choice (`address_allowed`): the
operator sends it the rollout's credentials and, through its queries, what it learns, so an
address outside the operator's allow-list is refused before anything is read or sent.
"""
from __future__ import annotations

import asyncio
import base64
import math
import ssl
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote
from urllib.parse import SplitResult, unquote, urlsplit

import httpx

from graft.rollout.observation import Measurement
from graft.rollout.queries import Series


TRANSPORT = "transport"   # unreachable, or no answer within the timeout
HTTP = "http"             # an answer, but not the API's: refused credentials, no JSON
QUERY = "query"           # Prometheus refused the query (bad PromQL, its own timeout)
PARSE = "parse"           # an answer that is not one number (several series, a matrix, a malformed body)
NON_FINITE = "non-finite"  # +Inf or -Inf: NaN counts as no data


class ProviderError(Exception):
    """Prometheus could not give the number asked for; `kind` says which way, the message why (for the status)."""

    def __init__(self, kind: str, message: str, *, outage: bool = False):
        super().__init__(message)
        self.kind = kind
        self.outage = outage or kind == TRANSPORT     # Prometheus down or restarting: it passes by itself


TOKEN_MARGIN = 30.0        # an OAuth2 token is asked for again this long before it expires


def basic_header(username: str, password: str) -> str:
    """The Authorization header of HTTP basic authentication."""
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


@dataclass(frozen=True, slots=True)
class OAuth2Login:
    """OAuth2 client credentials (RFC 6749 4.4), with the client secret as read from its Secret."""

    token_url: str
    client_id: str
    client_secret: str
    scopes: tuple[str, ...] = ()


class OAuth2Auth(httpx.Auth):
    """Bearer tokens from a token endpoint: one token for every query until shortly before it expires,
    a new one once after a 401. Concurrent queries wait for the one token request in flight."""

    def __init__(self, login: OAuth2Login):
        self.login = login
        self.token: str | None = None
        self.expires = 0.0
        self.requests = 0                   # token requests made (the bench and the tests read it)
        self._lock = asyncio.Lock()

    def _token_request(self) -> httpx.Request:
        # client_secret_basic: the credentials form-encoded, then as HTTP basic (RFC 6749 2.3.1)
        user, secret = quote(self.login.client_id, safe=""), quote(self.login.client_secret, safe="")
        data = {"grant_type": "client_credentials"}
        if self.login.scopes:
            data["scope"] = " ".join(self.login.scopes)
        return httpx.Request("POST", self.login.token_url, data=data,
                             headers={"Authorization": basic_header(user, secret), "Accept": "application/json"})

    def _take(self, reply: httpx.Response) -> None:
        where = f"the OAuth2 token endpoint {self.login.token_url}"
        try:
            body = reply.json()
        except ValueError:
            body = None
        if reply.status_code != 200 or not isinstance(body, dict) or not isinstance(body.get("access_token"), str):
            why = body.get("error") if isinstance(body, dict) and body.get("error") else f"HTTP {reply.status_code}"
            raise ProviderError(HTTP, f"{where} gave no access token ({why})",
                                outage=reply.status_code >= 500)
        expires_in = body.get("expires_in")
        ttl = float(expires_in) if isinstance(expires_in, (int, float)) and expires_in > 0 else 3600.0
        self.token, self.expires = body["access_token"], time.monotonic() + max(ttl - TOKEN_MARGIN, ttl / 2)

    async def async_auth_flow(self, request: httpx.Request):
        refused: str | None = None          # on the one retry: the token a 401 refused
        while True:
            async with self._lock:
                # a token is asked for when there is none, when it expires, or after a 401 unless
                # another query's retry has already replaced the refused one
                if self.token is None or (self.token == refused if refused else time.monotonic() >= self.expires):
                    self.requests += 1
                    reply = yield self._token_request()
                    await reply.aread()
                    self._take(reply)
                used = self.token
            request.headers["Authorization"] = f"Bearer {used}"
            response = yield request
            if response.status_code != 401 or refused is not None:
                return
            refused = used

    def sync_auth_flow(self, request: httpx.Request):
        raise RuntimeError("OAuth2Auth serves the operator's async client only")


def tls_context(ca_pem: str | None, client_cert: tuple[str, str] | None) -> ssl.SSLContext | bool:
    """What httpx verifies with: the system's CAs or `ca_pem`, presenting `client_cert` (PEM
    certificate, PEM key) when given."""
    if not ca_pem and not client_cert:
        return True
    context = ssl.create_default_context(cadata=ca_pem or None)
    if client_cert:
        # ssl loads a client certificate from files only: written for the moment it takes, mode 0600
        with tempfile.TemporaryDirectory() as folder:
            cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
            for path, data in ((cert, client_cert[0]), (key, client_cert[1])):
                path.write_text(data)
                path.chmod(0o600)
            try:
                context.load_cert_chain(cert, key)
            except ssl.SSLError as e:
                raise ProviderError(HTTP, f"the client certificate and key do not load: {e.reason or e}") from None
    return context


class PrometheusProvider:
    def __init__(self, address: str, timeout: float = 5.0, *, headers: dict[str, str] | None = None,
                 ca_pem: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 oauth2: OAuth2Login | None = None, client_cert: tuple[str, str] | None = None):
        self.address, self.timeout = address.rstrip("/"), timeout
        self.oauth2 = OAuth2Auth(oauth2) if oauth2 is not None else None
        self._client = httpx.AsyncClient(base_url=self.address, headers=headers or {},
                                         verify=tls_context(ca_pem, client_cert),
                                         timeout=httpx.Timeout(timeout + 1.0), transport=transport,
                                         auth=self.oauth2)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def query(self, promql: str) -> float | None:
        """One number, or None when the query has no data."""
        try:
            r = await self._client.get("/api/v1/query", params={"query": promql, "timeout": f"{self.timeout:g}s"})
        except httpx.TimeoutException:
            raise ProviderError(TRANSPORT, f"Prometheus at {self.address} did not answer within "
                                           f"{self.timeout:g}s") from None
        except httpx.HTTPError as e:
            raise ProviderError(TRANSPORT, f"Prometheus at {self.address} is unreachable: "
                                           f"{type(e).__name__}: {e}") from None
        except ssl.SSLError as e:       # TLS 1.3 says a client certificate is missing after the handshake
            raise ProviderError(HTTP, f"Prometheus at {self.address} refused the TLS connection: "
                                      f"{e.reason or e}") from None
        if r.status_code in (401, 403):
            raise ProviderError(HTTP, f"Prometheus at {self.address} refused the credentials (HTTP {r.status_code})")
        try:
            body = r.json()
        except ValueError:   # json.JSONDecodeError and UnicodeDecodeError alike
            raise ProviderError(HTTP, f"Prometheus at {self.address} answered HTTP {r.status_code} "
                                      "without JSON", outage=r.status_code >= 500) from None
        if not isinstance(body, dict):
            raise ProviderError(PARSE, f"Prometheus at {self.address} answered a JSON {type(body).__name__}, "
                                       "not an object")
        if body.get("status") != "success":
            # 503 is Prometheus starting up or its query timeout under load; 502/504 a proxy before it
            raise ProviderError(QUERY, f"Prometheus refused the query ({body.get('errorType', r.status_code)}: "
                                       f"{body.get('error', 'no reason given')})",
                                outage=r.status_code in (502, 503, 504))
        return _number(body.get("data") or {})

    async def measure(self, plan: list[tuple[object, list[Series]]]) -> list[Measurement]:
        """A Measurement per check of `plan` (graft.rollout.analysis.plan_run)."""
        return list(await asyncio.gather(*(self._measure(check.key, series) for check, series in plan)))

    async def _measure(self, key: str, series: list[Series]) -> Measurement:
        try:
            values = await asyncio.gather(*(self.query(s.promql) for s in series))
        except ProviderError as e:
            return Measurement(key, error=str(e), outage=e.outage)
        return Measurement(key, {s.key: v for s, v in zip(series, values)})


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _parts(url: str) -> tuple[str, str, int, str] | None:
    """(scheme, host, port, path without trailing slash) of a plain http(s) URL; None for anything
    else: another scheme, no host, credentials, a query, a fragment, a bad port, or `.`/`..` path
    segments (which would climb out of an allowed path)."""
    try:
        u: SplitResult = urlsplit(url.strip())
        port = u.port
    except ValueError:
        return None
    scheme = u.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not u.hostname or "@" in u.netloc or u.query or u.fragment \
            or url.rstrip().endswith(("?", "#")):
        return None
    path = u.path.rstrip("/")
    if any(unquote(segment) in (".", "..") for segment in path.split("/")):
        return None
    return scheme, u.hostname.lower(), port or _DEFAULT_PORTS[scheme], path


def valid_prefix(url: str) -> bool:
    """Whether `url` can stand in an allow-list of Prometheus addresses."""
    return _parts(url) is not None


def address_allowed(address: str, allowed: list[str] | tuple[str, ...]) -> bool:
    """Whether `address` is one of the `allowed` prefixes: scheme, host and port the same (the
    scheme's port when none is written), and its path the prefix's path or below it, segment by
    segment (`http://prom:9090/org` allows `/org` and `/org/a`, not `/organisation`)."""
    mine = _parts(address)
    if mine is None:
        return False
    for prefix in allowed:
        theirs = _parts(prefix)
        if theirs is not None and mine[:3] == theirs[:3] and (
                mine[3] == theirs[3] or mine[3].startswith(theirs[3] + "/")):
            return True
    return False


def _number(data: dict) -> float | None:
    """The one number of a query's `data`; ProviderError (PARSE) for anything else."""
    if not isinstance(data, dict):
        raise ProviderError(PARSE, f"the query's data is a {type(data).__name__}, not an object")
    kind, result = data.get("resultType"), data.get("result")
    try:
        if kind == "scalar":
            raw = result[1]
        elif kind == "vector":
            if not result:
                return None
            if len(result) > 1:
                raise ProviderError(PARSE, f"the query returned {len(result)} series; a check needs one number")
            raw = result[0]["value"][1]
        else:
            raise ProviderError(PARSE, f"the query returned a {kind}; a check needs an instant vector or a scalar")
    except (KeyError, IndexError, TypeError):   # a body that is not the API's shape
        raise ProviderError(PARSE, f"the query's {kind} result is malformed: {result!r:.200}") from None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ProviderError(PARSE, f"the query returned {raw!r}, not a number") from None
    if math.isnan(value):      # 0/0, a ratio over no requests: no data, as an empty vector
        return None
    if math.isinf(value):      # x/0 and the like: a number no check can judge, and one JSON cannot hold
        raise ProviderError(NON_FINITE, f"the query returned {raw!r}, not a finite number "
                                        "(a ratio over an empty denominator?)")
    return value
