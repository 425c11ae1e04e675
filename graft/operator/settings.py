"""Operator settings, read from the environment (the Helm chart sets them) or given by tests.

Kubernetes login, chosen in this order:
- `GRAFT_KUBE_SERVER`: a plain URL, no credentials (the local dev cluster);
- `GRAFT_KUBECONFIG`: a kubeconfig file (its current context, or `GRAFT_KUBE_CONTEXT`);
- otherwise kopf's own: the in-cluster service account, then `KUBECONFIG` / `~/.kube/config`.

The engines' admin token: `GRAFT_ADMIN_TOKEN` itself, or the Secret named by
`GRAFT_ADMIN_TOKEN_SECRET` (`namespace/name`) under the key `GRAFT_ADMIN_TOKEN_SECRET_KEY`
(default `token`), read through the API and re-read every `GRAFT_ADMIN_TOKEN_TTL` seconds.
The admin API is called over https, the engines' certificate verified against
`GRAFT_ADMIN_CA_FILE` (a PEM CA bundle; `GRAFT_ADMIN_SCHEME=https` alone trusts the system's CAs)
for the name `GRAFT_ADMIN_TLS_SERVER_NAME` when set (a pod's certificate usually names its Service,
not its IP). The token in those calls runs code on every engine, so plain HTTP is refused at start
unless `GRAFT_ADMIN_PLAIN_HTTP=true` opts out (one machine's loopback, as the dev cluster). An
engine refusing the token is retried for `GRAFT_ADMIN_TOKEN_GRACE` seconds (a rotation reaches the
operator and the engines at different moments) before the rollout fails.

The fleet controller knows what each engine runs from what the operator did and from its
container's identity (graft.operator.revisions), and asks an engine again only after
`GRAFT_FLEET_RESYNC_SECONDS` (300, jittered), at most `GRAFT_FLEET_ADMIN_CONCURRENCY` (8) questions
of one fleet in flight at once.

Prometheus: `GRAFT_PROMETHEUS_ADDRESS` for rollouts that name none; a rollout may name another
only when it lies under one of `GRAFT_PROMETHEUS_ALLOWED` (comma-separated URL prefixes: scheme,
host and port exact, the path a prefix; the default address is always allowed). The Secrets a
rollout names for it (bearerTokenSecret, caSecret) are read only in the namespaces of
`GRAFT_PROMETHEUS_SECRET_NAMESPACES` (comma-separated; none by default), the ones the cluster
administrator granted the operator a Role for.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from graft.operator.prometheus import valid_prefix


@dataclass(slots=True)
class OperatorSettings:
    namespaces: list[str] = field(default_factory=list)   # empty: every namespace
    tick: float = 5.0                     # seconds between two reconciliations of a rollout
    kube_server: str | None = None
    kubeconfig: str | None = None
    kube_context: str | None = None
    admin_token: str | None = None
    admin_token_secret: str | None = None  # namespace/name
    admin_token_key: str = "token"
    admin_token_ttl: float = 60.0
    admin_token_grace: float = 120.0       # seconds an engine may refuse the token before it is final
    admin_port: int = 8081                 # when a pod names no admin port
    admin_scheme: str = "https"
    admin_plain_http: bool = False         # opt-out: call engines over plain http
    admin_ca_file: str | None = None       # PEM CA bundle: the admin API is called over verified https
    admin_tls_server_name: str | None = None  # the name the engines' certificate must carry
    admin_timeout: float = 60.0            # seconds per admin API call: an apply runs the self-check (seconds on a CPU)
    admin_concurrency: int = 16            # admin API calls in flight at once
    admin_retries: int = 2                 # retries of a call that did not reach the engine
    fleet_resync: float = 300.0            # seconds before an engine's known revision is asked again (jittered)
    fleet_admin_concurrency: int = 8       # a fleet's revision questions in flight at once
    prometheus_timeout: float = 5.0
    prometheus_address: str = "http://prometheus.monitoring:9090"   # for rollouts that name none
    prometheus_allowed: list[str] = field(default_factory=list)     # other addresses rollouts may name (prefixes)
    prometheus_secret_namespaces: list[str] = field(default_factory=list)   # where Prometheus Secrets are read
    metrics_port: int | None = None        # the operator's own /metrics; None: not served
    peering: str | None = None             # kopf peering name; None: standalone (one replica)

    def __post_init__(self) -> None:
        if self.tick <= 0:
            raise ValueError("tick must be positive")
        if self.admin_token_secret is not None and self.admin_token_secret.count("/") != 1:
            raise ValueError(f"GRAFT_ADMIN_TOKEN_SECRET must be namespace/name, got {self.admin_token_secret!r}")
        if self.admin_scheme not in ("http", "https"):
            raise ValueError("admin_scheme must be http or https")
        if self.admin_ca_file and self.admin_scheme != "https":
            raise ValueError("GRAFT_ADMIN_CA_FILE is for https: leave GRAFT_ADMIN_SCHEME unset or set it to https")
        if self.admin_scheme == "http" and not self.admin_plain_http:
            raise ValueError(PLAIN_HTTP_REFUSED)
        if self.fleet_resync <= 0:
            raise ValueError("GRAFT_FLEET_RESYNC_SECONDS must be positive")
        if self.fleet_admin_concurrency < 1:
            raise ValueError("GRAFT_FLEET_ADMIN_CONCURRENCY must be at least 1")
        if self.admin_token_grace < 0:
            raise ValueError("GRAFT_ADMIN_TOKEN_GRACE must not be negative")
        for prefix in [self.prometheus_address, *self.prometheus_allowed]:
            if not valid_prefix(prefix):
                raise ValueError(f"Prometheus address {prefix!r} (GRAFT_PROMETHEUS_ADDRESS, GRAFT_PROMETHEUS_ALLOWED) "
                                 "must be an http(s) URL with a host and no credentials, query or fragment")

    @property
    def prometheus_prefixes(self) -> list[str]:
        """The addresses a rollout may name: the default one and GRAFT_PROMETHEUS_ALLOWED."""
        return [self.prometheus_address, *self.prometheus_allowed]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorSettings":
        env = os.environ if env is None else env

        def number(name: str, default: float) -> float:
            raw = env.get(name)
            try:
                return float(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name} must be a number, got {raw!r}") from None

        return cls(
            namespaces=[n.strip() for n in env.get("GRAFT_NAMESPACES", "").split(",") if n.strip()],
            tick=number("GRAFT_TICK_SECONDS", 5.0),
            kube_server=env.get("GRAFT_KUBE_SERVER") or None,
            kubeconfig=env.get("GRAFT_KUBECONFIG") or None,
            kube_context=env.get("GRAFT_KUBE_CONTEXT") or None,
            admin_token=env.get("GRAFT_ADMIN_TOKEN") or None,
            admin_token_secret=env.get("GRAFT_ADMIN_TOKEN_SECRET") or None,
            admin_token_key=env.get("GRAFT_ADMIN_TOKEN_SECRET_KEY") or "token",
            admin_token_ttl=number("GRAFT_ADMIN_TOKEN_TTL", 60.0),
            admin_port=int(number("GRAFT_ADMIN_PORT", 8081)),
            admin_scheme=_admin_scheme(env),
            admin_plain_http=_flag(env, "GRAFT_ADMIN_PLAIN_HTTP"),
            admin_token_grace=number("GRAFT_ADMIN_TOKEN_GRACE", 120.0),
            admin_ca_file=env.get("GRAFT_ADMIN_CA_FILE") or None,
            admin_tls_server_name=env.get("GRAFT_ADMIN_TLS_SERVER_NAME") or None,
            admin_timeout=number("GRAFT_ADMIN_TIMEOUT", 60.0),
            admin_concurrency=int(number("GRAFT_ADMIN_CONCURRENCY", 16)),
            admin_retries=int(number("GRAFT_ADMIN_RETRIES", 2)),
            fleet_resync=number("GRAFT_FLEET_RESYNC_SECONDS", 300.0),
            fleet_admin_concurrency=int(number("GRAFT_FLEET_ADMIN_CONCURRENCY", 8)),
            prometheus_timeout=number("GRAFT_PROMETHEUS_TIMEOUT", 5.0),
            prometheus_address=env.get("GRAFT_PROMETHEUS_ADDRESS") or "http://prometheus.monitoring:9090",
            prometheus_allowed=_names(env.get("GRAFT_PROMETHEUS_ALLOWED")),
            prometheus_secret_namespaces=_names(env.get("GRAFT_PROMETHEUS_SECRET_NAMESPACES")),
            metrics_port=int(number("GRAFT_METRICS_PORT", 0)) or None,
            peering=env.get("GRAFT_PEERING") or None,
        )


def _names(raw: str | None) -> list[str]:
    return [n.strip() for n in (raw or "").split(",") if n.strip()]


PLAIN_HTTP_REFUSED = ("the engines' admin API carries the token that runs code on every engine: call it over "
                      "TLS (GRAFT_ADMIN_CA_FILE, the CA of the engines' certificate, or GRAFT_ADMIN_SCHEME=https "
                      "for the system's CAs), or set GRAFT_ADMIN_PLAIN_HTTP=true to opt out")


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ValueError(f"{name} must be true or false, got {env.get(name)!r}")


def _admin_scheme(env: Mapping[str, str]) -> str:
    """https when a CA is given; with no TLS setting at all, http only for an explicit opt-out,
    otherwise the refusal names the choices (the dataclass check)."""
    if env.get("GRAFT_ADMIN_SCHEME"):
        return env["GRAFT_ADMIN_SCHEME"]
    if env.get("GRAFT_ADMIN_CA_FILE"):
        return "https"
    return "http"
