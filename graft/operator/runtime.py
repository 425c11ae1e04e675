"""What every handler shares: settings, the Kubernetes and admin API clients, Prometheus providers,
one lock per rollout (so two reconciliations of one rollout never overlap), and the login."""
from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime, timezone
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import kopf

from graft.api import Reason
from graft.adminapi import AdminClient
from graft.operator.kube import Kube, KubeError, secret_path, secret_value
from graft.operator.kubeconfig import EXPIRY_MARGIN, load_credentials
from graft.operator.hooks import HookCaller
from graft.operator.jobs import JobProvider
from graft.operator.metrics import OperatorMetrics
from graft.operator.notify import Notifier, receivers_from_env
from graft.operator.outbox import Outbox
from graft.operator.podcache import PodCache
from graft.operator.problems import PrometheusRefused, SecretError, TokenError
from graft.operator.prometheus import OAuth2Login, PrometheusProvider, address_allowed, basic_header
from graft.operator.web import WebProvider, allowed_url
from graft.operator.revisions import RecordingAdmin, RevisionBook
from graft.operator.settings import OperatorSettings
from graft.rollout.observation import Problem
from graft.rollout.spec import PrometheusSource

__all__ = ["Runtime", "PrometheusRefused", "SecretError", "TokenError"]



class Runtime:
    def __init__(self, settings: OperatorSettings):
        self.settings = settings
        self.kube: Kube | None = None
        self._login: kopf.ConnectionInfo | None = None   # what self.kube was made from
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # what each engine runs, known from the operator's own applies and reverts (every one goes
        # through this client) and from container identity; the fleet asks engines only beyond it
        self.revisions = RevisionBook(settings.fleet_resync)
        # the pods of each namespace acted in, kept by a watch: ticks read them without listing
        self.pod_cache = PodCache(lambda: self.kube, watch_seconds=settings.pod_watch_seconds)
        self._admin = RecordingAdmin(AdminClient(
            settings.admin_token, scheme=settings.admin_scheme, timeout=settings.admin_timeout,
            concurrency=settings.admin_concurrency, retries=settings.admin_retries, ca_file=settings.admin_ca_file,
            tls_server_name=settings.admin_tls_server_name), self.revisions)
        self._token_read_at = float("-inf")
        # namespace/pod -> (when its engine first refused the token, refusals in a row since)
        self.unauthorized: dict[str, tuple[float, int]] = {}
        self._reported: set[tuple[str, str]] = set()   # (object, pod uid) already reported as no engine
        self._providers: dict[tuple, PrometheusProvider] = {}
        self.web = WebProvider()
        self.jobs = JobProvider()
        self.metrics = OperatorMetrics()
        # notifications and webhooks: gates are awaited by reconciliations, everything else leaves
        # through the outbox in the background (graft.operator.notify, graft.operator.hooks)
        self.outbox = Outbox()
        self.hooks = HookCaller(self.outbox)
        self.notifier = Notifier(receivers_from_env({**os.environ, "GRAFT_NOTIFICATIONS": settings.notifications or ""}),
                                 self.outbox)
        self.closed = False

    # Kubernetes login, chosen by settings
    async def login(self, logger: Any = None, **kwargs: Any) -> kopf.ConnectionInfo | None:
        s = self.settings
        if s.kube_server:
            info = kopf.ConnectionInfo(server=s.kube_server, insecure=True)
        else:       # GRAFT_KUBECONFIG, else the service account in a pod, else $KUBECONFIG or ~/.kube/config
            info = await asyncio.to_thread(_from_kubeconfig, s.kubeconfig, s.kube_context)
        if info is not None:
            await self.connect(info)
            await self._check_token(logger)
        return info

    async def _check_token(self, logger: Any) -> None:
        """Say at once when the engines' admin token cannot be read, rather than at the first rollout."""
        if not self.settings.admin_token_secret or logger is None:
            return
        try:
            await self.admin()
        except TokenError as e:
            logger.error(f"admin token: {e.problem.message}; every rollout will report {e.problem.reason} until "
                         "it exists (the Secret lives in the operator's own namespace: see the chart's README)")
        except Exception as e:   # noqa: BLE001 - a start-up diagnosis must never stop the login
            logger.warning(f"admin token: could not check Secret {self.settings.admin_token_secret}: {e}")

    async def connect(self, info: kopf.ConnectionInfo) -> None:
        """Use kopf's login; a token read again (kopf logs in anew when it expires or after a 401)
        replaces the old one in the same client, so watches and calls in flight go on."""
        if self.kube is not None and self._login is not None and _same_but_token(self._login, info):
            self.kube.use_headers(info.as_http_headers())
            self._login = info
            return
        old, self.kube, self._login = self.kube, Kube.from_connection(info), info
        if old is not None:
            await old.aclose()

    async def admin(self) -> RecordingAdmin:
        """The admin API client with a current token; raises TokenError when the Secret is missing."""
        s = self.settings
        if s.admin_token_secret and time.monotonic() - self._token_read_at > s.admin_token_ttl:
            namespace, name = s.admin_token_secret.split("/")
            secret = await self.kube.get(secret_path(namespace, name))
            where = f"Secret {namespace}/{name}"
            if secret is None:
                raise TokenError(Problem(Reason.ADMIN_TOKEN_MISSING, f"{where} (the engines' admin token) not found"))
            token = secret_value(secret, s.admin_token_key)
            if not token:
                raise TokenError(Problem(Reason.ADMIN_TOKEN_MISSING, f"{where} has no key {s.admin_token_key!r}"))
            self._admin.token, self._token_read_at = token.strip(), time.monotonic()
        return self._admin

    def report_once(self, about: str, pod_uid: str) -> bool:
        """True the first time `about` (the object an Event goes to) reports the pod `pod_uid`."""
        key = (about, pod_uid)
        if key in self._reported:
            return False
        if len(self._reported) > 10_000:       # pods come and go: forget the oldest reports wholesale
            self._reported.clear()
        self._reported.add(key)
        return True

    def invalidate_token(self) -> None:
        """Read the token Secret again before the next call (an engine refused the one we hold)."""
        self._token_read_at = float("-inf")

    def prometheus_refusal(self, source: PrometheusSource, namespace: str) -> Problem | None:
        """Why the operator will not ask the Prometheus a rollout names (a permanent Problem), or None:
        an address outside the allow-list, or Secrets in a namespace where it does not read them."""
        s = self.settings
        if source.address and not address_allowed(source.address, s.prometheus_prefixes):
            return Problem(Reason.PROMETHEUS_NOT_ALLOWED,
                           f"spec.analysis.prometheus.address: {source.address} is not a Prometheus this "
                           f"operator may ask (allowed: {', '.join(s.prometheus_prefixes)}; the cluster "
                           "administrator sets them with GRAFT_PROMETHEUS_ALLOWED, the chart's "
                           "prometheus.allowedAddresses)", permanent=True)
        if source.oauth2 is not None and not address_allowed(source.oauth2.token_url, s.prometheus_prefixes):
            return Problem(Reason.PROMETHEUS_NOT_ALLOWED,
                           f"spec.analysis.prometheus.oauth2.tokenUrl: {source.oauth2.token_url} is not an address "
                           f"this operator may send credentials to (allowed: {', '.join(s.prometheus_prefixes)}; "
                           "GRAFT_PROMETHEUS_ALLOWED, the chart's prometheus.allowedAddresses)", permanent=True)
        named = [f for f, _ in source.secrets()]
        if named and namespace not in s.prometheus_secret_namespaces:
            return Problem(Reason.PROMETHEUS_SECRETS_NOT_ALLOWED,
                           f"spec.analysis.prometheus.{named[0]}: this operator reads no Prometheus Secrets in "
                           f"namespace {namespace} (the cluster administrator enables them per namespace: "
                           "GRAFT_PROMETHEUS_SECRET_NAMESPACES, the chart's rbac.prometheusSecrets)",
                           permanent=True)
        return None

    async def provider(self, source: PrometheusSource, namespace: str) -> PrometheusProvider:
        """The provider for a rollout's Prometheus: its address (or the operator's default), with the
        bearer token and CA bundle read from Secrets in the rollout's namespace. Raises
        PrometheusRefused, before any Secret is read, for a source `prometheus_refusal` refuses."""
        refusal = self.prometheus_refusal(source, namespace)
        if refusal is not None:
            raise PrometheusRefused(refusal)
        headers = dict(source.headers)
        values = {f: await self._secret_key(namespace, *ref, f) for f, ref in source.secrets()}
        if source.bearer_token_secret is not None:
            headers["Authorization"] = f"Bearer {values['bearerTokenSecret'].strip()}"
        if source.basic_auth is not None:
            headers["Authorization"] = basic_header(source.basic_auth[0], values["basicAuth.passwordSecret"].strip())
        oauth2 = None if source.oauth2 is None else OAuth2Login(
            source.oauth2.token_url, source.oauth2.client_id, values["oauth2.clientSecretSecret"].strip(),
            source.oauth2.scopes)
        client_cert = None if source.client_cert is None else (values["tls.certSecret"], values["tls.keySecret"])
        address = source.address or self.settings.prometheus_address
        # a provider per distinct login: what the Secrets hold now is part of it, so a rotated one takes effect
        key = (address, tuple(sorted(headers.items())), values.get("caSecret"), oauth2, client_cert)
        if key not in self._providers:
            self._providers[key] = PrometheusProvider(address, self.settings.prometheus_timeout, headers=headers,
                                                      ca_pem=values.get("caSecret"), oauth2=oauth2,
                                                      client_cert=client_cert)
        return self._providers[key]

    def web_refusal(self, checks: Iterable[Any], namespace: str) -> Problem | None:
        """Why the operator will not ask a web check's service (a permanent Problem), or None: a URL
        outside GRAFT_WEB_ALLOWED, or a header Secret in a namespace where it reads none."""
        s = self.settings
        for check in checks:
            web = check.web
            if not allowed_url(web.url, s.web_allowed):
                allowed = ", ".join(s.web_allowed) or "none"
                return Problem(Reason.WEB_NOT_ALLOWED,
                               f"check {check.name}: web.url {web.url} is not an address this operator may ask "
                               f"(allowed: {allowed}; the cluster administrator sets them with GRAFT_WEB_ALLOWED, "
                               "the chart's webChecks.allowedAddresses)", permanent=True)
            if any(ref is not None for _, _, ref in web.headers) and namespace not in s.prometheus_secret_namespaces:
                return Problem(Reason.PROMETHEUS_SECRETS_NOT_ALLOWED,
                               f"check {check.name}: web.headers: this operator reads no Secrets in namespace "
                               f"{namespace} (GRAFT_PROMETHEUS_SECRET_NAMESPACES, the chart's rbac.prometheusSecrets)",
                               permanent=True)
        return None

    def job_refusal(self, checks: Iterable[Any]) -> Problem | None:
        """Why the operator will not run a job check's Job (a permanent Problem), or None: job checks
        are off (GRAFT_JOB_CHECKS), or the pod would run as a service account not allowed
        (GRAFT_JOB_SERVICE_ACCOUNTS): a rollout's author gets no rights through the operator that the
        administrator did not hand out."""
        s = self.settings
        for check in checks:
            if not s.job_checks:
                return Problem(Reason.JOB_NOT_ALLOWED,
                               f"check {check.name}: this operator runs no job checks (the cluster administrator "
                               "turns them on with GRAFT_JOB_CHECKS, the chart's jobChecks.enabled)", permanent=True)
            pod = (check.job.spec.get("template") or {}).get("spec") or {}
            account = pod.get("serviceAccountName") or pod.get("serviceAccount") or "default"
            if account not in s.job_service_accounts:
                return Problem(Reason.JOB_NOT_ALLOWED,
                               f"check {check.name}: job.spec.template.spec.serviceAccountName {account!r} is not a "
                               f"service account job checks may run as (allowed: {', '.join(s.job_service_accounts)}; "
                               "GRAFT_JOB_SERVICE_ACCOUNTS, the chart's jobChecks.serviceAccounts)", permanent=True)
        return None

    async def web_headers(self, web: Any, namespace: str) -> dict[str, str]:
        """A web check's headers, each value from the spec or read from its Secret."""
        out = {}
        for name, value, ref in web.headers:
            out[name] = value if ref is None else (await self._secret_key(namespace, *ref, f"spec.analysis check {web.url} headers[{name}]")).strip()
        return out

    async def _secret_key(self, namespace: str, name: str, key: str, field: str) -> str:
        """A Secret's key in the rollout's namespace; `field` names what asked for it (under
        spec.analysis.prometheus unless it is a path of its own)."""
        field = field if field.startswith("spec.") else f"spec.analysis.prometheus.{field}"
        try:
            secret = await self.kube.get(secret_path(namespace, name))
        except KubeError as e:
            if e.status != 403:
                raise
            raise SecretError(Problem(Reason.PROMETHEUS_SECRET_MISSING,
                                      f"{field}: the operator may not read Secret "
                                      f"{namespace}/{name} (no Role grants it: the chart's rbac.prometheusSecrets)")
                              ) from None
        value = secret_value(secret, key) if secret is not None else None
        if not value:
            raise SecretError(Problem(Reason.PROMETHEUS_SECRET_MISSING,
                                      f"{field}: Secret {namespace}/{name} "
                                      + ("not found" if secret is None else f"has no key {key!r}")))
        return value

    async def close(self) -> None:
        self.closed = True          # timers still firing during shutdown find nothing to do
        for lock in list(self.locks.values()):      # let reconciliations in flight finish their calls
            try:
                await asyncio.wait_for(lock.acquire(), 10)
                lock.release()
            except TimeoutError:
                pass
        await self.outbox.drain(5)        # what reconciliations just told, sent before the client goes
        await self.outbox.aclose()
        await self.hooks.aclose()
        await self._admin.aclose()
        await self.pod_cache.aclose()
        for provider in self._providers.values():
            await provider.aclose()
        await self.web.aclose()
        if self.kube is not None:
            await self.kube.aclose()


def _from_kubeconfig(path: str | None, context: str | None) -> kopf.ConnectionInfo:
    """kopf's connection from the credentials Graft's own client uses (graft.operator.kubeconfig:
    a kubeconfig's context, token files, client certificates, exec plugins; a pod's service account)."""
    creds = load_credentials(path, context)
    # kopf logs in again when this passes: an exec plugin's token, a token file the kubelet rotates
    expiration = None if creds.expires_at is None else \
        datetime.fromtimestamp(creds.expires_at - EXPIRY_MARGIN, timezone.utc)
    return kopf.ConnectionInfo(
        server=creds.server, ca_data=creds.ca_data, insecure=creds.insecure,
        username=creds.username, password=creds.password, token=creds.token,
        scheme="Bearer" if creds.token else None, expiration=expiration,
        certificate_data=creds.certificate, private_key_data=creds.private_key,
        default_namespace=creds.namespace)


def _same_but_token(old: kopf.ConnectionInfo, new: kopf.ConnectionInfo) -> bool:
    """Whether two logins differ in their token or password only (same server, same TLS)."""
    fields = ("server", "ca_data", "ca_path", "insecure", "certificate_data", "certificate_path",
              "private_key_data", "private_key_path", "proxy_url")
    return all(getattr(old, f) == getattr(new, f) for f in fields)
