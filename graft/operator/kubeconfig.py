"""Kubernetes credentials, as kubectl finds them: a kubeconfig's context, or a pod's service account.

`load_credentials(path, context)` reads, in kubectl's order:
- `path` if given, else every file of `$KUBECONFIG` (merged: the first file to name an entry wins),
  else `~/.kube/config`; with none of them and no `path` or `context`, inside a pod
  (`KUBERNETES_SERVICE_HOST`), its service account (token, CA, namespace);
- the context `context`, else the kubeconfig's `current-context`: its cluster (`server`,
  `certificate-authority[-data]`, `insecure-skip-tls-verify`, `tls-server-name`) and user (`token`,
  `tokenFile`, `client-certificate[-data]` with `client-key[-data]`, `username`/`password`, or an
  `exec` credential plugin answering a token or a client certificate), and its `namespace`.

What cannot be read is a `KubeconfigError` naming the file and the entry. Relative file names are
relative to the kubeconfig that holds them, as kubectl reads them.

Credentials that age are read again, as client-go does: an exec plugin's token when its
`expirationTimestamp` passes (or the API server answers 401), a `tokenFile` or a service account's
token (which the kubelet rotates in place) every `FILE_TOKEN_RELOAD` seconds. `Credentials.expires_at`
says when; `reload()` reads them anew from where they came from; `RefreshingAuth` does both for an
httpx client, so a dashboard left open for a day keeps working.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import ssl
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
FILE_TOKEN_RELOAD = 60.0   # seconds between two reads of a token file (the kubelet rotates a pod's in place)
EXPIRY_MARGIN = 30.0       # an expiring token is fetched again this long before it expires


class KubeconfigError(Exception):
    """Credentials that cannot be loaded: the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """One API server and one identity: what every Graft client of Kubernetes is built from."""

    server: str
    namespace: str = "default"              # the context's namespace (a pod: its own)
    token: str | None = None
    username: str | None = None
    password: str | None = None
    ca_data: bytes | None = None            # PEM: the API server's CA (None: the system's)
    certificate: bytes | None = None        # PEM client certificate, with `private_key`
    private_key: bytes | None = None
    insecure: bool = False                  # insecure-skip-tls-verify
    tls_server_name: str | None = None
    expires_at: float | None = None         # epoch seconds after which the token must be read again
    # where they were read from, to read them again: ("kubeconfig", path, context) or ("pod", folder)
    origin: tuple[str | None, ...] | None = None

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at - EXPIRY_MARGIN

    def reload(self) -> "Credentials":
        """The same identity read anew (the plugin run again, the file read again)."""
        if self.origin is None:
            return self
        if self.origin[0] == "pod":
            return service_account(Path(self.origin[1] or SERVICE_ACCOUNT))
        return load_credentials(*self.origin[1:])

    def headers(self) -> dict[str, str]:
        """The Authorization header of this identity (none for a client certificate or no credentials)."""
        if self.token:
            return {"Authorization": f"Bearer {self.token}"}
        if self.username and self.password:
            basic = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            return {"Authorization": f"Basic {basic}"}
        return {}

    def ssl_context(self) -> ssl.SSLContext | bool:
        """What httpx verifies with: False for plain http or insecure-skip-tls-verify, else a context
        trusting `ca_data` (or the system's CAs) and presenting the client certificate, if any."""
        if not self.server.startswith("https:"):
            return False
        context = ssl.create_default_context(cadata=self.ca_data.decode() if self.ca_data else None)
        if self.insecure:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if self.certificate and self.private_key:
            # ssl loads a client certificate from files only: written for the moment it takes, mode 0600
            with tempfile.TemporaryDirectory() as folder:
                cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
                for path, data in ((cert, self.certificate), (key, self.private_key)):
                    path.write_bytes(data)
                    path.chmod(0o600)
                context.load_cert_chain(cert, key)
        return context


def in_cluster() -> bool:
    """Whether this process runs in a pod with a service account (and no KUBECONFIG says otherwise)."""
    return "KUBERNETES_SERVICE_HOST" in os.environ and not os.environ.get("KUBECONFIG") \
        and (SERVICE_ACCOUNT / "token").exists()


def load_credentials(path: str | os.PathLike[str] | None = None, context: str | None = None) -> Credentials:
    """The credentials kubectl would use (see the module docstring); KubeconfigError when there are none."""
    if path is None and context is None and in_cluster():
        return service_account()
    files = [Path(path).expanduser()] if path is not None else _default_files()
    config = _merged(files)
    name = context or config.get("current-context")
    if not name:
        raise KubeconfigError(f"{_names(files)}: no context given and no current-context set")
    ctx = _entry(config, "contexts", name, files)
    cluster = _entry(config, "clusters", ctx.get("cluster"), files)
    user = _entry(config, "users", ctx.get("user"), files, required=False)
    where = config["__origin__"]
    server = cluster.get("server")
    if not server:
        raise KubeconfigError(f"{_names(files)}: cluster {ctx.get('cluster')!r} has no server")
    creds: dict[str, Any] = {
        "server": str(server).rstrip("/"), "namespace": ctx.get("namespace") or "default",
        "insecure": bool(cluster.get("insecure-skip-tls-verify")), "tls_server_name": cluster.get("tls-server-name"),
        "ca_data": _data(cluster, "certificate-authority", where["clusters"].get(ctx.get("cluster"))),
    }
    base = where["users"].get(ctx.get("user"))
    expires_at = None
    if user.get("exec"):
        user = {**user, **_exec(user["exec"], ctx.get("user"))}
        expires_at = user.pop("__expires_at__", None)
    token = user.get("token")
    if not token and user.get("tokenFile"):
        token = _read(_relative(user["tokenFile"], base), "tokenFile").decode().strip()
        expires_at = time.time() + FILE_TOKEN_RELOAD
    creds["expires_at"] = expires_at if token else None   # a plugin's certificate is kept as given
    creds["origin"] = ("kubeconfig", None if path is None else str(path), name)
    creds.update(token=token or None, username=user.get("username"), password=user.get("password"),
                 certificate=_data(user, "client-certificate", base), private_key=_data(user, "client-key", base))
    if bool(creds["certificate"]) != bool(creds["private_key"]):
        raise KubeconfigError(f"{_names(files)}: user {ctx.get('user')!r} has a client certificate without its key "
                              "or a key without its certificate")
    if user.get("auth-provider"):
        raise KubeconfigError(f"{_names(files)}: user {ctx.get('user')!r} uses an auth-provider, which Graft does "
                              "not support: use an exec credential plugin or a token")
    return Credentials(**creds)


def service_account(root: Path = SERVICE_ACCOUNT) -> Credentials:
    """A pod's own identity: its service account token, the cluster's CA, its namespace."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise KubeconfigError("KUBERNETES_SERVICE_HOST is not set: not in a pod")
    host = f"[{host}]" if ":" in host else host
    namespace = root / "namespace"
    return Credentials(server=f"https://{host}:{port}", token=_read(root / "token", "token").decode().strip(),
                       ca_data=_read(root / "ca.crt", "ca.crt"),
                       namespace=namespace.read_text().strip() if namespace.exists() else "default",
                       expires_at=time.time() + FILE_TOKEN_RELOAD, origin=("pod", str(root)))


def _default_files() -> list[Path]:
    env = os.environ.get("KUBECONFIG")
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return [Path("~/.kube/config").expanduser()]


def _names(files: list[Path]) -> str:
    return ", ".join(map(str, files)) or "kubeconfig"


def _merged(files: list[Path]) -> dict[str, Any]:
    """The files merged as kubectl merges them: the first to set a value or to name an entry wins.
    `__origin__` keeps, per kind and name, the file an entry came from (its relative paths' base)."""
    merged: dict[str, Any] = {"current-context": None, "clusters": {}, "contexts": {}, "users": {},
                              "__origin__": {"clusters": {}, "contexts": {}, "users": {}}}
    found = False
    for path in files:
        if not path.exists() and len(files) > 1:
            continue        # $KUBECONFIG may name files that are not there
        text = _read(path, "kubeconfig").decode("utf-8", "replace")
        found = True
        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise KubeconfigError(f"{path}: not YAML: {e}") from None
        if not isinstance(doc, dict):
            raise KubeconfigError(f"{path}: not a kubeconfig (a YAML mapping)")
        if not merged["current-context"]:
            merged["current-context"] = doc.get("current-context") or None
        for kind, inner in (("clusters", "cluster"), ("contexts", "context"), ("users", "user")):
            for item in doc.get(kind) or []:
                if isinstance(item, dict) and item.get("name") not in merged[kind]:
                    merged[kind][item.get("name")] = item.get(inner) or {}
                    merged["__origin__"][kind][item.get("name")] = path.parent
    if not found:
        raise KubeconfigError(f"no kubeconfig found ({_names(files)})")
    return merged


def _entry(config: dict[str, Any], kind: str, name: Any, files: list[Path], required: bool = True) -> dict[str, Any]:
    entry = config[kind].get(name)
    if entry is None and required:
        raise KubeconfigError(f"{_names(files)}: no {kind[:-1]} named {name!r}")
    if entry is not None and not isinstance(entry, dict):
        raise KubeconfigError(f"{_names(files)}: {kind[:-1]} {name!r} is not a mapping")
    return entry or {}


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise KubeconfigError(f"cannot read {what} {path}: {e.strerror or e}") from None


def _relative(name: str, base: Path | None) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() or base is None else base / path


def _data(entry: dict[str, Any], key: str, base: Path | None) -> bytes | None:
    """`key-data` (base64) or the file `key` names, as bytes; None when neither is set."""
    if entry.get(f"{key}-data"):
        try:
            return base64.b64decode(entry[f"{key}-data"], validate=True)
        except ValueError:
            raise KubeconfigError(f"{key}-data is not base64") from None
    if entry.get(key):
        return _read(_relative(entry[key], base), key)
    return None


def _exec(spec: dict[str, Any], user: Any) -> dict[str, Any]:
    """Run an exec credential plugin (client.authentication.k8s.io) and answer the user fields it
    gives: a token, or a client certificate and key."""
    command = spec.get("command")
    if not command:
        raise KubeconfigError(f"user {user!r}: exec has no command")
    env = {**os.environ, **{e["name"]: e["value"] for e in spec.get("env") or [] if "name" in e}}
    api_version = spec.get("apiVersion") or "client.authentication.k8s.io/v1"
    env["KUBERNETES_EXEC_INFO"] = json.dumps({"apiVersion": api_version, "kind": "ExecCredential",
                                              "spec": {"interactive": False}})
    try:
        done = subprocess.run([command, *(spec.get("args") or [])], env=env, capture_output=True, timeout=60,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KubeconfigError(f"user {user!r}: exec {command}: {e}") from None
    if done.returncode != 0:
        raise KubeconfigError(f"user {user!r}: exec {command} exited {done.returncode}: "
                              f"{done.stderr.decode(errors='replace').strip()[:200]}")
    status: dict[str, Any] = {}
    with contextlib.suppress(ValueError, AttributeError):
        status = json.loads(done.stdout).get("status") or {}
    if status.get("token"):
        return {"token": status["token"], "__expires_at__": _timestamp(status.get("expirationTimestamp"))}
    if status.get("clientCertificateData") and status.get("clientKeyData"):
        return {"client-certificate-data": base64.b64encode(status["clientCertificateData"].encode()).decode(),
                "client-key-data": base64.b64encode(status["clientKeyData"].encode()).decode()}
    raise KubeconfigError(f"user {user!r}: exec {command} answered no token and no client certificate")


def _timestamp(text: Any) -> float | None:
    """An RFC 3339 time as epoch seconds; None when absent (the token is kept until a 401)."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class RefreshingAuth(httpx.Auth):
    """The bearer token of `creds`, read again before it expires and once after a 401.

    A 401 that reading the credentials again does not change (a literal token in the kubeconfig) is
    the API server's answer and is passed on as it is. In an event loop the plugin runs in a thread."""

    def __init__(self, creds: Credentials):
        self._creds = creds
        self._lock = threading.Lock()       # one reload at a time, whichever thread asks

    @property
    def credentials(self) -> Credentials:
        return self._creds

    def _stale(self, used: str | None = None) -> bool:
        return self._creds.origin is not None and (self._creds.expired() or
                                                  (used is not None and self._creds.token == used))

    def _reload(self, used: str | None = None) -> Credentials:
        with self._lock:
            if self._stale(used):           # another request may have reloaded them meanwhile
                self._creds = self._creds.reload()
            return self._creds

    def sync_auth_flow(self, request: httpx.Request):
        creds = self._reload() if self._stale() else self._creds
        request.headers.update(creds.headers())
        response = yield request
        if response.status_code == 401 and creds.origin is not None:
            fresh = self._reload(used=creds.token)
            if fresh.token != creds.token:
                request.headers.update(fresh.headers())
                yield request

    async def async_auth_flow(self, request: httpx.Request):
        creds = await asyncio.to_thread(self._reload) if self._stale() else self._creds
        request.headers.update(creds.headers())
        response = yield request
        if response.status_code == 401 and creds.origin is not None:
            fresh = await asyncio.to_thread(self._reload, creds.token)
            if fresh.token != creds.token:
                request.headers.update(fresh.headers())
                yield request
