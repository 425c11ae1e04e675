"""`graft rollout lint -f FILE [-f FILE ...]`: check manifests before they reach a cluster.

Every PatchRollout, PatchFleet and (Cluster)PatchAnalysisTemplate document of the files is read by
the very code the operator reads it with (graft.rollout.spec), and, where the CRDs and a reviewer
of them are at hand, as the API server admits it (strict field validation, the CRD's schema and its
CEL rules), so lint refuses what either would. Other documents (a ConfigMap, a Service) are left
alone. A rollout's analysis templates are taken from the files given; one that is not there is
said so and its checks are left out (in a cluster it must exist, or the rollout fails).

Errors: one line each, `FILE, document N (Kind namespace/name): field.path: what is wrong` (documents
counted from 1 in each file, `(API server)` after a refusal of the CRD's schema), exit 1. Otherwise
each document is printed as YAML as the operator will see it, exit 0: the API server's defaults
filled in, and a rollout's breakers and gates spelled out as it runs them (the default analysis
when it names none, a template's checks merged with its own, each check's window and consecutive
breaches). Notes are YAML comments, so the output is YAML still.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.text import Text

from graft.api import API_VERSION
from graft.rollout.durations import format_duration
from graft.rollout.spec import (BREAKER, DEFAULT_REVISION_HISTORY_LIMIT, K8S_NAME_PATTERN, Check, FieldError,
                                RolloutSpec, SpecError, parse_fleet_spec, parse_spec, template_refs, with_defaults)

ROLLOUT, FLEET = "PatchRollout", "PatchFleet"
TEMPLATE, CLUSTER_TEMPLATE = "PatchAnalysisTemplate", "ClusterPatchAnalysisTemplate"
KINDS = (ROLLOUT, FLEET, TEMPLATE, CLUSTER_TEMPLATE)
# a source checkout's CRDs (an installed package has none: --crds names them)
CRDS = Path(__file__).resolve().parents[2] / "crds"
# the value a template argument without one gets when the template is checked alone
ARG_PLACEHOLDER = "lint"
NO_CHECKS = "needs at least one breaker or gate"

# (folder of CRDs) -> a reviewer whose `review(obj)` answers (refusals, the object as stored) or
# None when no CRD serves the object; None where no reviewer can be made
Admission = Callable[[Path], Any]


@dataclass
class Document:
    file: str
    index: int                      # counted from 1 in its file
    obj: Any
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    expanded: dict[str, Any] | None = None

    @property
    def kind(self) -> str:
        return self.obj.get("kind", "") if isinstance(self.obj, dict) else ""

    @property
    def title(self) -> str:
        meta = self.obj.get("metadata") if isinstance(self.obj, dict) else None
        meta = meta if isinstance(meta, dict) else {}
        name = "/".join(str(p) for p in (meta.get("namespace"), meta.get("name")) if p)
        return f"{self.file}, document {self.index} ({self.kind or 'no kind'}{' ' + name if name else ''})"

    def fail(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")


def parser() -> argparse.ArgumentParser:
    from graft.operator.cli import EXIT_CODES

    p = argparse.ArgumentParser(
        prog="graft rollout lint", epilog=EXIT_CODES,
        description="Check PatchRollout, PatchFleet and analysis template manifests without a cluster: with the "
                    "operator's own reader and, where the CRDs are at hand, as the API server admits them. "
                    "Prints every error (file, document, field path) and exits 1, or prints each document as "
                    "the operator will see it, defaults filled in, and exits 0.")
    p.add_argument("-f", "--filename", action="append", required=True, metavar="FILE",
                   help="a YAML file of one or more documents; - reads stdin (repeatable: a rollout's analysis "
                        "templates may lie in another file)")
    p.add_argument("--crds", metavar="DIR", type=Path,
                   help="the folder of Graft's CRDs (default: crds/ of this source tree, when there)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing when every document is valid")
    return p


def main(argv: Sequence[str] | None = None, console: Console | None = None, admission: Admission | None = None) -> int:
    args = parser().parse_args(argv)
    console = console or Console()
    docs: list[Document] = []
    for name in _files(args.filename):
        try:
            text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
            loaded = list(yaml.safe_load_all(text))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            console.print(Text(f"error: cannot read {name}: {e}", style="red"))
            return 1
        docs += [Document(name, i, obj) for i, obj in enumerate((d for d in loaded if d is not None), 1)]
    ours = [d for d in docs if d.kind in KINDS or _graft_api(d.obj)]
    if args.crds is not None and not args.crds.is_dir():
        parser().error(f"--crds {args.crds}: no such folder")
    reviewer, unchecked = _reviewer(args.crds or CRDS, admission)
    templates = _templates(ours)
    for doc in docs:
        _lint(doc, templates, reviewer)
    bad = [d for d in docs if d.errors]
    if bad:
        for d in bad:
            for error in d.errors:
                console.out(f"{d.title}: {error}", highlight=False)
        if unchecked:
            console.out(f"note: {unchecked}", highlight=False)
        console.print(Text(f"{sum(len(d.errors) for d in bad)} error(s) in {len(bad)} of {len(ours)} document(s)",
                           style="red"))
        return 1
    if not args.quiet:
        console.out(_report(docs, unchecked), highlight=False)
    return 0


def _files(names: list[str]) -> list[str]:
    """The files named, a folder standing for its YAML files (as kubectl apply -f takes one)."""
    out = []
    for name in names:
        path = Path(name)
        if name != "-" and path.is_dir():
            out += sorted(str(p) for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
        else:
            out.append(name)
    return out


def _graft_api(obj: Any) -> bool:
    return isinstance(obj, dict) and str(obj.get("apiVersion", "")).startswith("graft.dev/")


def _reviewer(folder: Path, admission: Admission | None) -> tuple[Any, str]:
    """The API server's reviewer of the CRDs in `folder`, or None and why there is none."""
    if not folder.is_dir():
        return None, ("not checked against the CRDs' schemas: no crds/ folder here (give --crds DIR, e.g. the "
                      "chart's crds/)")
    if admission is None:
        return None, ("not checked against the CRDs' schemas: no validator was handed in (`graft rollout lint` and "
                      "`kubectl graft lint` hand one in)")
    reviewer = admission(folder)
    if reviewer is None:
        return None, ("not checked against the CRDs' schemas: that needs the devcluster extra "
                      "(pip install 'graft[devcluster]'), which the operator image leaves out")
    return reviewer, ""


Found = list[tuple[tuple[str, bool], str | None, dict[str, Any]]]


def _templates(docs: list[Document]) -> Found:
    """The analysis templates of the files: ((name, cluster-scoped), namespace, spec)."""
    out = []
    for d in docs:
        if d.kind in (TEMPLATE, CLUSTER_TEMPLATE) and isinstance(d.obj.get("metadata"), dict):
            meta, spec = d.obj["metadata"], d.obj.get("spec")
            if isinstance(meta.get("name"), str) and isinstance(spec, dict):
                out.append(((meta["name"], d.kind == CLUSTER_TEMPLATE), meta.get("namespace"), spec))
    return out


def _namespace(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return meta.get("namespace") if isinstance(meta, dict) else None


def _visible(found: Found, namespace: str | None) -> dict[tuple[str, bool], dict[str, Any]]:
    """The templates a rollout in `namespace` can name: every cluster one, and the namespaced ones of
    its namespace (either unset: kubectl's namespace decides, so taken for the same)."""
    return {key: spec for key, ns, spec in found if key[1] or not ns or not namespace or ns == namespace}


def _lint(doc: Document, templates: Found, reviewer: Any) -> None:
    if doc.kind not in KINDS:
        if _graft_api(doc.obj):
            doc.fail("kind", f"{doc.kind or None!r} is not a kind of {doc.obj['apiVersion']} (one of {', '.join(KINDS)})")
        else:
            doc.notes.append("not a Graft resource: left alone")
        return
    obj = doc.obj
    if obj.get("apiVersion") != API_VERSION:
        doc.fail("apiVersion", f"must be {API_VERSION}, not {obj.get('apiVersion')!r}")
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        doc.fail("metadata", "required: an object with a name")
        meta = {}
    name = meta.get("name")
    if name is None and not meta.get("generateName"):
        doc.fail("metadata.name", "required")
    elif name is not None and (not isinstance(name, str) or not re.fullmatch(K8S_NAME_PATTERN, name)):
        doc.fail("metadata.name", f"{name!r} is not a valid name (lower-case letters, digits, '-' and '.', "
                                  "starting and ending alphanumeric, at most 253 characters)")
    stored, refusals = obj, []
    if reviewer is not None and not doc.errors:
        answer = reviewer.review(obj)
        if answer is not None:
            refusals, stored = answer
    spec = stored.get("spec")
    try:
        if doc.kind == ROLLOUT:
            doc.expanded = _rollout(doc, spec, _visible(templates, _namespace(doc.obj)))
        elif doc.kind == FLEET:
            parse_fleet_spec(spec)
            doc.expanded = copy.deepcopy(spec)
            doc.expanded.setdefault("revisionHistoryLimit", DEFAULT_REVISION_HISTORY_LIMIT)
        else:
            _template(doc, spec)
            doc.expanded = copy.deepcopy(spec)
    except SpecError as e:
        doc.errors += [str(error) for error in e.errors]
    doc.errors += [f"{e} (API server)" for e in refusals]


def _rollout(doc: Document, spec: Any, templates: dict[tuple[str, bool], dict[str, Any]]) -> dict[str, Any]:
    """The spec as the operator reads it (graft.rollout.spec), its checks spelled out; a template
    that is not in the files is noted and stands empty (so the rest is still checked)."""
    refs = template_refs(spec) if isinstance(spec, dict) else []
    missing = [ref for ref in refs if ref not in templates]
    for name, cluster in missing:
        doc.notes.append(f"{CLUSTER_TEMPLATE if cluster else TEMPLATE} {name} is not in the files given: its checks "
                         "are not checked here (add its file with another -f)")
    parsed: RolloutSpec | None = None
    try:
        parsed = parse_spec(spec, {**templates, **{ref: {} for ref in missing}})
    except SpecError as e:
        # with a template left out, "no breaker or gate" may be that template's to answer
        errors = [x for x in e.errors if not (missing and x.path == "spec.analysis" and x.message == NO_CHECKS)]
        if errors:
            raise SpecError(errors) from None
    expanded = with_defaults(spec)
    if parsed is not None:
        analysis = expanded["analysis"]
        for key, checks in (("breakers", parsed.analysis.breakers), ("gates", parsed.analysis.gates)):
            analysis[key] = [check_to_dict(c) for c in checks]
        if refs:
            doc.notes.append("breakers and gates: the templates' merged with the rollout's own, as the operator "
                             "runs them")
        elif "breakers" not in (spec.get("analysis") or {}) and "gates" not in (spec.get("analysis") or {}):
            doc.notes.append("breakers and gates: the default analysis (docs/analysis.md)")
    return expanded


def _template(doc: Document, spec: Any) -> None:
    """A template alone: read as a rollout naming it reads it (its checks, its arguments filled in, a
    namespaced one's queries scoped to the namespace), an argument without a value standing as
    `lint`. Errors are given at the template's own field paths."""
    if not isinstance(spec, dict):
        raise SpecError([FieldError("spec", "must be an object")])
    meta = doc.obj.get("metadata")
    name = (meta.get("name") if isinstance(meta, dict) else None) or "template"
    cluster = doc.kind == CLUSTER_TEMPLATE
    args = spec.get("args") if isinstance(spec.get("args"), list) else []
    unset = [a["name"] for a in args if isinstance(a, dict) and isinstance(a.get("name"), str)
             and re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,62}", a["name"]) and a.get("value") is None]
    probe = {"selector": {"matchLabels": {"app": "lint"}}, "patch": {"name": "lint", "version": "1"},
             "analysis": {"templates": [{"name": name, "clusterScope": cluster}],
                          **({"args": [{"name": a, "value": ARG_PLACEHOLDER} for a in unset]} if unset else {})}}
    try:
        parse_spec(probe, {(name, cluster): spec})
    except SpecError as e:
        prefix = f"{doc.kind} {name}: "
        errors = []
        for x in e.errors:
            if x.path.startswith(prefix):
                errors.append(FieldError(x.path[len(prefix):], x.message))
            elif x.path == "spec.analysis" and x.message == NO_CHECKS:
                errors.append(FieldError("spec", NO_CHECKS))
            else:
                errors.append(x)
        raise SpecError(errors) from None


def check_to_dict(check: Check) -> dict[str, Any]:
    """A parsed check spelled as a manifest spells it, every default written out."""
    out: dict[str, Any] = {"name": check.name}
    if check.metric not in (check.name, "custom"):
        out["metric"] = check.metric
    for key, value in (("max", check.max), ("min", check.min), ("maxRatio", check.max_ratio)):
        if value is not None:
            out[key] = int(value) if float(value).is_integer() else value
    out["window"] = check.window_text
    if check.role == BREAKER:
        out["consecutive"] = check.consecutive
    if check.query is not None:
        out["query"] = check.query
    if check.web is not None:
        out["web"] = web_to_dict(check.web)
    if check.job is not None:
        out["job"] = job_to_dict(check.job)
    if check.min_samples is not None:
        out["minSamples"] = check.min_samples
    if check.dry_run:
        out["dryRun"] = True
    return out


def _report(docs: list[Document], unchecked: str) -> str:
    """Every document as YAML, each under comments naming it (and anything said of it)."""
    parts = []
    for d in docs:
        head = f"# {d.title}: " + ("valid" if d.expanded is not None else (d.notes or [""])[0])
        notes = [f"# note: {n}" for n in (d.notes if d.expanded is not None else d.notes[1:])]
        if d.expanded is None:
            parts.append("\n".join([head, *notes]))
            continue
        obj = {**{k: d.obj[k] for k in ("apiVersion", "kind", "metadata") if k in d.obj}, "spec": d.expanded}
        parts.append("\n".join([head, *notes]) + "\n---\n"
                     + yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=100).rstrip())
    if not any(d.expanded is not None for d in docs):
        parts.append(f"# no {', '.join(KINDS)} document: nothing to check")
    return "\n".join(parts) + (f"\n# note: {unchecked}" if unchecked else "")


def web_to_dict(web: Any) -> dict[str, Any]:
    """A web check's request spelled as a manifest spells it (template arguments already filled)."""
    out: dict[str, Any] = {"url": web.url, "method": web.method}
    if web.body is not None:
        out["body"] = web.body
    if web.headers:
        out["headers"] = [{"name": name, "value": value} if ref is None else
                          {"name": name, "valueFrom": {"secretKeyRef": {"name": ref[0], "key": ref[1]}}}
                          for name, value, ref in web.headers]
    out["jsonPath"] = web.json_path
    out["timeout"] = f"{web.timeout:g}s"
    return out


def job_to_dict(job: Any) -> dict[str, Any]:
    """A job check spelled as a manifest spells it (template arguments already filled; what the
    operator adds to the Job it makes, graft.operator.jobs, is the Job's, not the check's)."""
    out: dict[str, Any] = {}
    if job.labels or job.annotations:
        out["metadata"] = {k: dict(v) for k, v in (("labels", job.labels), ("annotations", job.annotations)) if v}
    out["spec"] = job.spec
    if job.json_path is not None:
        out["jsonPath"] = job.json_path
    out["timeout"] = format_duration(job.timeout)
    return out
