"""Services of type ClusterIP in the dev cluster: an address per Service, a proxy behind it, and the
variables a container finds them by.

- **Allocation** (kube-apiserver, at create): a Service with no `spec.clusterIP` gets one, and
  `clusterIPs`, `type: ClusterIP`, `sessionAffinity: None`, each port's `protocol: TCP` and
  `targetPort` (its port) are filled in; `clusterIP: None` is a headless Service and keeps it. An
  update that changes the address is refused as kube-apiserver refuses it (`field is immutable`).
  Addresses are drawn at random from 127.96.0.0/11 of the loopback (the pods' are 127.0.0.x), so
  two dev clusters on one machine, each with its own API server, do not pick the same one.
- **kube-proxy** (`ServiceProxy`, run by the pod runner): every `clusterIP:port` is a listening
  socket that forwards each connection to one Ready endpoint of the Service, in turn, at the
  port's `targetPort` (a name resolved from the pod's container ports). With no Ready endpoint a
  connection is closed at once, as a refused one. Endpoints change without the listener being
  opened again; a Service deleted closes its listeners.
- **Environment** (kubelet, at each container start): `{NAME}_SERVICE_HOST`, `{NAME}_SERVICE_PORT`
  (the first port) and `{NAME}_SERVICE_PORT_{PORT}` for named ports of every Service of the pod's
  namespace that has an address then (NAME and PORT upper-cased, `-` made `_`), before the
  container's own `env`, whose `$(VAR)` may use them.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

CLUSTER_IP_RANGE = ipaddress.ip_network("127.96.0.0/11")
HEADLESS = "None"
CONNECT_TIMEOUT = 5.0
_CHUNK = 1 << 16


class ImmutableClusterIP(ValueError):
    """An update that changes a Service's address (kube-apiserver's `field is immutable`)."""


def allocate(taken: set[str], rng: random.Random | None = None) -> str:
    """A free address of CLUSTER_IP_RANGE, not in `taken`."""
    rng = rng or random.SystemRandom()
    size = CLUSTER_IP_RANGE.num_addresses
    while True:
        ip = CLUSTER_IP_RANGE[rng.randrange(1, size - 1)]
        if str(ip) not in taken and ip.packed[-1] not in (0, 255):
            return str(ip)


def fill_service(obj: dict[str, Any], old: dict[str, Any] | None, taken: Iterable[str]) -> None:
    """What kube-apiserver writes into a Service it stores: its address (allocated on create, kept
    on update) and the defaults of its spec. ImmutableClusterIP for an update that moves it."""
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    had = ((old or {}).get("spec") or {}).get("clusterIP")
    if old is not None and had:
        if spec.get("clusterIP") not in (None, "", had):
            raise ImmutableClusterIP(f'Invalid value: "{spec["clusterIP"]}": field is immutable')
        spec["clusterIP"] = had
    elif not spec.get("clusterIP"):
        spec["clusterIP"] = allocate(set(taken))
    spec["clusterIPs"] = [spec["clusterIP"]]


def env_name(name: str) -> str:
    return name.upper().replace("-", "_").replace(".", "_")


def service_env(services: Iterable[dict[str, Any]]) -> dict[str, str]:
    """The variables kubelet gives a container for the Services of its namespace."""
    env: dict[str, str] = {}
    for svc in services:
        spec = svc.get("spec") or {}
        ip, ports = spec.get("clusterIP"), spec.get("ports") or []
        if not ip or ip == HEADLESS or not ports:
            continue
        prefix = env_name(svc["metadata"]["name"])
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{env_name(port['name'])}"] = str(port["port"])
    return env


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _target_port(pod: dict[str, Any], target: Any) -> int | None:
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    return None


def backends(svc: dict[str, Any], pods: Iterable[dict[str, Any]]) -> dict[int, list[tuple[str, int]]]:
    """Per service port: the (pod IP, port) of each Ready pod the Service's selector picks."""
    spec = svc.get("spec") or {}
    selector = spec.get("selector") or {}
    picked = [p for p in pods if selector and _ready(p) and (p.get("status") or {}).get("podIP")
              and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())]
    out: dict[int, list[tuple[str, int]]] = {}
    for port in spec.get("ports") or []:
        target = port.get("targetPort", port.get("port"))
        out[int(port["port"])] = [(p["status"]["podIP"], n) for p in picked
                                  if (n := _target_port(p, target)) is not None]
    return out


class _Listener:
    """One clusterIP:port: each connection goes to the next of `backends`, bytes piped both ways."""

    def __init__(self, address: tuple[str, int]):
        self.address = address
        self.backends: list[tuple[str, int]] = []
        self._turn = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, *self.address, reuse_address=True)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        try:
            if not self.backends:
                return
            self._turn = (self._turn + 1) % len(self.backends)
            host, port = self.backends[self._turn]
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
            except (OSError, TimeoutError):
                return
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            self._pipes.discard(task)
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        if writer.can_write_eof():
            writer.write_eof()


class ServiceProxy:
    """kube-proxy for one namespace: `sync` with its Services and pods after every pass."""

    def __init__(self) -> None:
        self._listeners: dict[tuple[str, int], _Listener] = {}

    @property
    def addresses(self) -> set[tuple[str, int]]:
        return set(self._listeners)

    async def sync(self, services: Iterable[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        want: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for svc in services:
            ip = (svc.get("spec") or {}).get("clusterIP")
            if not ip or ip == HEADLESS:
                continue
            for port, ends in backends(svc, pods).items():
                want[(ip, port)] = ends
        for address in set(self._listeners) - set(want):
            await self._listeners.pop(address).close()
        for address, ends in want.items():
            listener = self._listeners.get(address)
            if listener is None:
                listener = _Listener(address)
                try:
                    await listener.start()
                except OSError as e:        # held by another process: said once, tried again next pass
                    log.warning("service proxy: cannot listen on %s:%d (%s)", *address, e)
                    continue
                self._listeners[address] = listener
            listener.backends = ends

    async def aclose(self) -> None:
        for listener in self._listeners.values():
            await listener.close()
        self._listeners.clear()
