"""Operator settings, read from the environment (the Helm chart sets them), from `graft operator`'s
flags, or given by tests.

Each setting is declared once, as a field of `OperatorSettings` with its default, its bounds, its
environment variable and its flag (`setting(...)`); `from_env` and the flags (`add_setting_args`,
`from_args`) are generated from those declarations, so a flag and its variable meet the same checks
and are refused with the same message, naming both. A secret (the admin token) has a variable and
no flag: a command line is visible to every user of the machine.

Kubernetes login, chosen in this order:
- `GRAFT_KUBE_SERVER`: a plain URL, no credentials (the local dev cluster);
- `GRAFT_KUBECONFIG`: a kubeconfig file (its current context, or `GRAFT_KUBE_CONTEXT`);
- otherwise as kubectl (graft.operator.kubeconfig): the in-cluster service account, then
  `KUBECONFIG` / `~/.kube/config`.

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
of one fleet or one rollout in flight at once. Both read pods from one list-then-watch per
namespace (graft.operator.podcache), each watch request resumed after `GRAFT_POD_WATCH_SECONDS`.

Prometheus: `GRAFT_PROMETHEUS_ADDRESS` for rollouts that name none; a rollout may name another
only when it lies under one of `GRAFT_PROMETHEUS_ALLOWED` (comma-separated URL prefixes: scheme,
host and port exact, the path a prefix; the default address is always allowed). The Secrets a
rollout names for it (bearerTokenSecret, caSecret) are read only in the namespaces of
`GRAFT_PROMETHEUS_SECRET_NAMESPACES` (comma-separated; none by default), the ones the cluster
administrator granted the operator a Role for.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from graft.operator.prometheus import valid_prefix


@dataclass(frozen=True, slots=True)
class Setting:
    """How one setting is given and bounded: its environment variable, its flag (None: a secret,
    given by its variable alone), its help, and the range it must lie in."""

    env: str
    help: str
    flag: str | None = ""                  # "": --the-field-name
    short: str | None = None
    minimum: float | None = None
    positive: bool = False                 # > 0
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None

    def names(self, name: str) -> str:
        """How an error names the setting: its variable and its flag."""
        flag = self.flag_of(name)
        return f"{self.env} ({flag})" if flag else self.env

    def flag_of(self, name: str) -> str | None:
        return None if self.flag is None else (self.flag or "--" + name.replace("_", "-"))


def setting(default: Any = MISSING, *, factory: Any = MISSING, **how: Any) -> Any:
    """A field of OperatorSettings: its default (or `factory`) and `Setting(**how)`."""
    meta = {"setting": Setting(**how)}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(slots=True)
class OperatorSettings:
    namespaces: list[str] = setting(factory=list, env="GRAFT_NAMESPACES", flag="--namespace", short="-n", metavar="NS",
                                    help="watch only these namespaces (repeatable, or comma-separated); "
                                         "default: every namespace")
    tick: float = setting(5.0, env="GRAFT_TICK_SECONDS", positive=True,
                          help="seconds between two reconciliations of a rollout")
    kube_server: str | None = setting(None, env="GRAFT_KUBE_SERVER",
                                      help="API server URL without credentials (local dev cluster)")
    kubeconfig: str | None = setting(None, env="GRAFT_KUBECONFIG", help="kubeconfig file to log in with")
    kube_context: str | None = setting(None, env="GRAFT_KUBE_CONTEXT", flag="--context", help="kubeconfig context")
    admin_token: str | None = setting(None, env="GRAFT_ADMIN_TOKEN", flag=None,
                                      help="the engines' admin token itself")
    admin_token_secret: str | None = setting(None, env="GRAFT_ADMIN_TOKEN_SECRET",
                                             help="the Secret (namespace/name) holding the engines' admin token")
    admin_token_key: str = setting("token", env="GRAFT_ADMIN_TOKEN_SECRET_KEY", help="the key of that Secret")
    admin_token_ttl: float = setting(60.0, env="GRAFT_ADMIN_TOKEN_TTL", minimum=0,
                                     help="seconds before the token Secret is read again")
    admin_token_grace: float = setting(120.0, env="GRAFT_ADMIN_TOKEN_GRACE", minimum=0,
                                       help="seconds an engine may refuse the token before it is final")
    admin_port: int = setting(8081, env="GRAFT_ADMIN_PORT", minimum=1, maximum=65535,
                              help="the engines' admin port when a pod's template names none")
    # None (the environment says nothing of TLS): https with a CA file, http with the opt-out, else refused
    admin_scheme: str | None = setting("https", env="GRAFT_ADMIN_SCHEME", choices=("http", "https"),
                                       help="how the admin API is called: https (verified against --admin-ca-file, else the "
                                            "system's CAs) or http (only with --admin-plain-http)")
    admin_plain_http: bool = setting(False, env="GRAFT_ADMIN_PLAIN_HTTP",
                                     help="opt out of TLS: call the engines over plain http")
    admin_ca_file: str | None = setting(None, env="GRAFT_ADMIN_CA_FILE",
                                        help="PEM CA bundle the engines' certificates are verified against")
    admin_tls_server_name: str | None = setting(None, env="GRAFT_ADMIN_TLS_SERVER_NAME",
                                                help="the name the engines' certificate must carry")
    admin_timeout: float = setting(60.0, env="GRAFT_ADMIN_TIMEOUT", positive=True,
                                   help="seconds per admin API call (an apply runs the self-check)")
    admin_concurrency: int = setting(16, env="GRAFT_ADMIN_CONCURRENCY", minimum=1,
                                     help="admin API calls in flight at once")
    admin_retries: int = setting(2, env="GRAFT_ADMIN_RETRIES", minimum=0,
                                 help="retries of a call that did not reach the engine")
    fleet_resync: float = setting(300.0, env="GRAFT_FLEET_RESYNC_SECONDS", positive=True,
                                  help="seconds before an engine's known revision is asked again (jittered)")
    fleet_admin_concurrency: int = setting(8, env="GRAFT_FLEET_ADMIN_CONCURRENCY", minimum=1,
                                           help="a fleet's or a rollout's revision questions in flight at once")
    pod_watch_seconds: int = setting(300, env="GRAFT_POD_WATCH_SECONDS", minimum=1,
                                     help="seconds one pod watch request runs before it is resumed")
    prometheus_timeout: float = setting(5.0, env="GRAFT_PROMETHEUS_TIMEOUT", positive=True,
                                        help="seconds per Prometheus query")
    prometheus_address: str = setting("http://prometheus.monitoring:9090", env="GRAFT_PROMETHEUS_ADDRESS",
                                      help="the Prometheus of rollouts that name none")
    prometheus_allowed: list[str] = setting(factory=list, env="GRAFT_PROMETHEUS_ALLOWED",
                                            help="other Prometheus addresses rollouts may name (URL prefixes)")
    prometheus_secret_namespaces: list[str] = setting(factory=list, env="GRAFT_PROMETHEUS_SECRET_NAMESPACES",
                                                      help="namespaces where Prometheus Secrets are read")
    web_allowed: list[str] = setting(factory=list, env="GRAFT_WEB_ALLOWED",
                                     help="addresses web checks may ask (URL prefixes); none by default")
    job_checks: bool = setting(False, env="GRAFT_JOB_CHECKS",
                               help="run job checks: a Job per check and step in the rollout's namespace")
    job_service_accounts: list[str] = setting(factory=lambda: ["default"], env="GRAFT_JOB_SERVICE_ACCOUNTS",
                                              help="the service accounts a job check's pod may run as")
    metrics_port: int | None = setting(None, env="GRAFT_METRICS_PORT", minimum=1, maximum=65535,
                                       help="the port of the operator's own /metrics (0 or unset: not served)")
    peering: str | None = setting(None, env="GRAFT_PEERING",
                                  help="kopf peering name (several replicas); default: standalone")
    notifications: str | None = setting(None, env="GRAFT_NOTIFICATIONS", flag=None,
                                        help="notification receivers, a JSON list (graft.operator.notify; the chart "
                                             "writes it, each URL in a variable filled from a Secret)")

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_bounds(f.name, f.metadata["setting"], getattr(self, f.name))
        if self.admin_token_secret is not None and self.admin_token_secret.count("/") != 1:
            raise ValueError(f"GRAFT_ADMIN_TOKEN_SECRET must be namespace/name, got {self.admin_token_secret!r}")
        if self.admin_scheme is None:
            self.admin_scheme = "https" if self.admin_ca_file else "http"
        if self.admin_scheme not in ("http", "https"):
            raise ValueError(f"GRAFT_ADMIN_SCHEME (--admin-scheme) must be http or https, got {self.admin_scheme!r}")
        if self.admin_ca_file and self.admin_scheme != "https":
            raise ValueError("GRAFT_ADMIN_CA_FILE is for https: leave GRAFT_ADMIN_SCHEME unset or set it to https")
        if self.admin_scheme == "http" and not self.admin_plain_http:
            raise ValueError(PLAIN_HTTP_REFUSED)
        for prefix in [self.prometheus_address, *self.prometheus_allowed]:
            if not valid_prefix(prefix):
                raise ValueError(f"Prometheus address {prefix!r} (GRAFT_PROMETHEUS_ADDRESS, GRAFT_PROMETHEUS_ALLOWED) "
                                 "must be an http(s) URL with a host and no credentials, query or fragment")
        for prefix in self.web_allowed:
            if not valid_prefix(prefix):
                raise ValueError(f"web address {prefix!r} (GRAFT_WEB_ALLOWED) must be an http(s) URL with a host "
                                 "and no credentials, query or fragment")

    @property
    def prometheus_prefixes(self) -> list[str]:
        """The addresses a rollout may name: the default one and GRAFT_PROMETHEUS_ALLOWED."""
        return [self.prometheus_address, *self.prometheus_allowed]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorSettings":
        """From the environment variables of every setting; an unset or empty one takes its default."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            how: Setting = f.metadata["setting"]
            raw = env.get(how.env)
            if raw is None or raw.strip() == "":
                continue
            values[f.name] = _parse(f.name, f.type, how, raw)
        if "admin_scheme" not in values:
            values["admin_scheme"] = None       # derived from the CA file and the opt-out: see __post_init__
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> "OperatorSettings":
        """From the flags of `add_setting_args`, each falling back to its environment variable: a flag
        given is read exactly as its variable would be."""
        merged = dict(os.environ if env is None else env)
        for f in fields(cls):
            how: Setting = f.metadata["setting"]
            given = getattr(args, f.name, None) if how.flag is not None else None
            if given is not None:
                merged[how.env] = ",".join(given) if isinstance(given, list) else str(given)
        return cls.from_env(merged)


def add_setting_args(parser: argparse.ArgumentParser) -> None:
    """A flag for every setting that has one, with its variable and default in its help."""
    for f in fields(OperatorSettings):
        how: Setting = f.metadata["setting"]
        flag = how.flag_of(f.name)
        if flag is None:
            continue
        default = f.default_factory() if f.default is MISSING else f.default
        shown = "" if default in (None, [], "", False) else f"; default {default}"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": f"{how.help} (env {how.env}{shown})"}
        if f.type == "bool":
            kwargs.update(action="store_const", const="true")
        elif f.type == "list[str]":
            kwargs.update(action="append", metavar=how.metavar or "NAME")
        else:
            kwargs.update(metavar=how.metavar or f.name.split("_")[-1].upper())
            if how.choices:
                kwargs["choices"] = how.choices
        parser.add_argument(flag, *([how.short] if how.short else []), **kwargs)


def variable_only() -> list[str]:
    """The variables of the settings that have no flag (a secret, or what holds secrets)."""
    return [f.metadata["setting"].env for f in fields(OperatorSettings) if f.metadata["setting"].flag is None]


def _parse(name: str, kind: str, how: Setting, raw: str) -> Any:
    """A raw value (a variable's, or a flag's) as the field's type; ValueError naming the setting."""
    names = how.names(name)
    if kind == "list[str]":
        return [n.strip() for n in raw.split(",") if n.strip()]
    if kind == "bool":
        value = raw.strip().lower()
        if value in ("0", "false", "no"):
            return False
        if value in ("1", "true", "yes"):
            return True
        raise ValueError(f"{names} must be true or false, got {raw!r}")
    if kind in ("float", "int", "int | None"):
        try:
            number = float(raw)
        except ValueError:
            raise ValueError(f"{names} must be a number, got {raw!r}") from None
        if kind == "float":
            return number
        if not number.is_integer():
            raise ValueError(f"{names} must be a whole number, got {raw!r}")
        return None if kind == "int | None" and number == 0 else int(number)
    if how.choices and raw not in how.choices:
        raise ValueError(f"{names} must be one of {', '.join(how.choices)}, got {raw!r}")
    return raw


def _check_bounds(name: str, how: Setting, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    names = how.names(name)
    if how.positive and not value > 0:
        raise ValueError(f"{names} must be positive, got {value:g}")
    if how.minimum is not None and value < how.minimum:
        raise ValueError(f"{names} must be at least {how.minimum:g}, got {value:g}")
    if how.maximum is not None and value > how.maximum:
        raise ValueError(f"{names} must be at most {how.maximum:g}, got {value:g}")


PLAIN_HTTP_REFUSED = ("the engines' admin API carries the token that runs code on every engine: call it over "
                      "TLS (GRAFT_ADMIN_CA_FILE, the CA of the engines' certificate, or GRAFT_ADMIN_SCHEME=https "
                      "for the system's CAs), or set GRAFT_ADMIN_PLAIN_HTTP=true to opt out")
