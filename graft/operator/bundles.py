"""Patch sources for the admin API: built in, or a bundle read from a ConfigMap.

A bundle's digest is checked here, against the digest pinned in the PatchRollout, before anything
is sent to an engine (the engine checks again). A signature, when the ConfigMap has one under
`<key>.sig`, travels along for engines that require signed bundles (they verify it against the
rollout's `config`, which the signature covers). A signature that says it has expired
(`v2:<expires>:...`, see graft.engine.patches.bundle) is not sent: the rollout reports
SignatureExpired until the ConfigMap holds a fresh one.
"""
from __future__ import annotations

import hmac
import time
from datetime import datetime, timezone
from typing import Any

from graft.api import Reason, digest_of
from graft.operator.kube import Kube, configmap_path
from graft.operator.problems import BundleError
from graft.rollout.observation import Problem
from graft.rollout.spec import PatchSpec


def verify(source: str, pinned: str, where: str) -> None:
    actual = digest_of(source)
    if not hmac.compare_digest(actual, pinned.lower()):
        raise BundleError(Problem(Reason.DIGEST_MISMATCH, f"{where} has digest {actual}, but the rollout pins "
                                                    f"{pinned}; refusing to send it", permanent=True))


async def load_source(kube: Kube, namespace: str, patch: PatchSpec) -> dict[str, Any]:
    """The `source` of the POST body; raises BundleError with the Problem to report."""
    src = patch.source
    if src.builtin:
        return {"builtin": True}
    where = f"ConfigMap {namespace}/{src.config_map}"
    cm = await kube.get(configmap_path(namespace, src.config_map))
    if cm is None:
        raise BundleError(Problem(Reason.BUNDLE_MISSING, f"{where} not found"))
    data = cm.get("data") or {}
    if src.key not in data:
        raise BundleError(Problem(Reason.BUNDLE_MISSING, f"{where} has no key {src.key!r} "
                                                   f"(keys: {', '.join(sorted(data)) or 'none'})"))
    source = data[src.key]
    verify(source, src.digest, f"{where} key {src.key}")
    body = {"module": source, "digest": src.digest}
    signature = data.get(f"{src.key}.sig")
    if signature:
        body["signature"] = signature.strip()
        _check_expiry(body["signature"], f"{where} key {src.key}.sig")
    return body


def _check_expiry(signature: str, where: str) -> None:
    form, _, rest = signature.partition(":")
    expires = rest.partition(":")[0]
    if form == "v2" and expires.isdigit() and int(expires) <= time.time():
        when = datetime.fromtimestamp(int(expires), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        raise BundleError(Problem(Reason.SIGNATURE_EXPIRED, f"{where} expired at {when}; sign the bundle again with "
                                                      "`graft patch sign` (or `graft patch pack --key`)"))
