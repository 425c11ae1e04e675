"""Operator settings, read from the environment (the Helm chart sets them) or given by tests.

Kubernetes login, chosen in this order:
- `GRAFT_KUBE_SERVER`: a plain URL, no credentials (the local dev cluster);
- `GRAFT_KUBECONFIG`: a kubeconfig file (its current context, or `GRAFT_KUBE_CONTEXT`);
- otherwise kopf's own: the in-cluster service account, then `KUBECONFIG` / `~/.kube/config`.

The engines' admin token: `GRAFT_ADMIN_TOKEN` itself, or the Secret named by
`GRAFT_ADMIN_TOKEN_SECRET` (`namespace/name`) under the key `GRAFT_ADMIN_TOKEN_SECRET_KEY`
(default `token`), read through the API and re-read every `GRAFT_ADMIN_TOKEN_TTL` seconds.
With `GRAFT_ADMIN_CA_FILE` (a PEM CA bundle) the admin API is called over https and the engines'
certificate verified, for the name `GRAFT_ADMIN_TLS_SERVER_NAME` when set (a pod's certificate
usually names its Service, not its IP).

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
    admin_port: int = 8081                 # when a pod names no admin port
    admin_scheme: str = "http"
    admin_ca_file: str | None = None       # PEM CA bundle: the admin API is called over verified https
    admin_tls_server_name: str | None = None  # the name the engines' certificate must carry
    admin_timeout: float = 60.0            # seconds per admin API call: an apply runs the self-check (seconds on a CPU)
    admin_concurrency: int = 16            # admin API calls in flight at once
    admin_retries: int = 2                 # retries of a call that did not reach the engine
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
            admin_scheme=env.get("GRAFT_ADMIN_SCHEME") or ("https" if env.get("GRAFT_ADMIN_CA_FILE") else "http"),
            admin_ca_file=env.get("GRAFT_ADMIN_CA_FILE") or None,
            admin_tls_server_name=env.get("GRAFT_ADMIN_TLS_SERVER_NAME") or None,
            admin_timeout=number("GRAFT_ADMIN_TIMEOUT", 60.0),
            admin_concurrency=int(number("GRAFT_ADMIN_CONCURRENCY", 16)),
            admin_retries=int(number("GRAFT_ADMIN_RETRIES", 2)),
            prometheus_timeout=number("GRAFT_PROMETHEUS_TIMEOUT", 5.0),
            prometheus_address=env.get("GRAFT_PROMETHEUS_ADDRESS") or "http://prometheus.monitoring:9090",
            prometheus_allowed=_names(env.get("GRAFT_PROMETHEUS_ALLOWED")),
            prometheus_secret_namespaces=_names(env.get("GRAFT_PROMETHEUS_SECRET_NAMESPACES")),
            metrics_port=int(number("GRAFT_METRICS_PORT", 0)) or None,
            peering=env.get("GRAFT_PEERING") or None,
        )


def _names(raw: str | None) -> list[str]:
    return [n.strip() for n in (raw or "").split(",") if n.strip()]
