"""`graft rollout lint`: manifests checked offline with the operator's reader (graft.rollout.spec)
and, through `graft rollout` and `kubectl graft`, as the API server admits them (the CRDs' schemas
and CEL rules, strict fields); valid documents printed as the operator will see them."""
import copy
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from graft.cli import crd_admission
from graft.operator.cli import main_rollout
from graft.rollout.spec import DEFAULT_BREAKERS, DEFAULT_GATES, SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
TEMPLATE = ROOT / "examples" / "analysis-template-gpu.yaml"


def lint(*argv, admission=crd_admission):
    console = Console(record=True, width=400, force_terminal=False)
    code = main_rollout(["lint", *map(str, argv)], console, admission=admission)
    return code, console.export_text()


def documents(out):
    return [d for d in yaml.safe_load_all(out) if d]


def templates_of(*paths):
    docs = [d for p in paths for d in yaml.safe_load_all(Path(p).read_text()) if d]
    return {(d["metadata"]["name"], d["kind"] == "ClusterPatchAnalysisTemplate"): d["spec"] for d in docs
            if d["kind"].endswith("PatchAnalysisTemplate")}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_and_reads_as_the_operator_reads_it(path):
    code, out = lint("-f", path)
    assert code == 0, out
    assert "not checked against the CRDs' schemas" not in out, "the CRD check ran"
    originals = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(path.read_text())
                 if d and d.get("apiVersion") == "graft.dev/v1alpha1"}
    printed = {(d["kind"], d["metadata"]["name"]): d for d in documents(out)}
    assert set(printed) == set(originals), out
    templates = templates_of(TEMPLATE)
    for (kind, name), doc in printed.items():
        if kind != "PatchRollout":
            continue
        spec = doc["spec"]
        assert spec["analysis"]["measurementRetention"] == 10 and spec["steps"][-1]["weight"] == 100
        # the spelled-out spec is the same rollout to the operator as the manifest
        assert parse_spec(spec, templates) == parse_spec(originals[(kind, name)]["spec"], templates), name


def test_the_default_analysis_is_spelled_out_and_every_example_lints_together():
    code, out = lint("-f", ROOT / "examples" / "rollout-builtin.yaml")
    assert code == 0, out
    (doc,) = documents(out)
    analysis = doc["spec"]["analysis"]
    assert [c["name"] for c in analysis["breakers"]] == [c["name"] for c in DEFAULT_BREAKERS]
    assert [c["name"] for c in analysis["gates"]] == [c["name"] for c in DEFAULT_GATES]
    cpu = next(c for c in analysis["breakers"] if c["name"] == "cpu")
    assert cpu == {"name": "cpu", "max": 0.92, "window": "120s", "consecutive": 3}
    assert doc["spec"]["trafficRouting"] == {"podRatio": {}} and doc["spec"]["patch"]["source"] == {"builtin": {}}
    assert "# note: breakers and gates: the default analysis" in out
    # a folder stands for its files; the template of one file serves the rollout of another
    code, out = lint("-f", ROOT / "examples", "-q")
    assert code == 0 and out == "", out


def test_a_template_in_another_file_is_merged_and_a_missing_one_is_said(tmp_path):
    rollout = ROOT / "examples" / "rollout-with-template.yaml"
    code, out = lint("-f", rollout)
    assert code == 0, out
    assert "ClusterPatchAnalysisTemplate gpu-canary-checklist is not in the files given" in out
    assert "breakers" not in documents(out)[0]["spec"]["analysis"]
    code, out = lint("-f", TEMPLATE, "-f", rollout)
    assert code == 0, out
    merged = documents(out)[1]["spec"]["analysis"]
    assert {c["name"] for c in merged["gates"]} == {"success-rate", "error-rate-delta"}, merged
    assert "the templates' merged with the rollout's own" in out


BAD = """\
apiVersion: v1
kind: ConfigMap
metadata: {name: left-alone}
---
apiVersion: graft.dev/v1alpha1
kind: PatchRollout
metadata: {name: bad, namespace: llm}
spec:
  selector: {matchLabels: {app: llm-engine}}
  patch: {name: kv-align, version: "3.2.1"}
  steps: [{weight: 50}, {weight: 20}, {weight: 100}]
  analysis:
    measurementRetention: 101
    breakers: [{name: error-rate, max: 2}]
  colour: blue
---
apiVersion: graft.dev/v1alpha1
kind: PatchFleet
metadata: {name: everything}
spec:
  selector: {matchExpressions: [{key: app, operator: Exists}]}
---
apiVersion: graft.dev/v1alpha1
kind: PatchAnalysisTemplate
metadata: {name: slo, namespace: llm}
spec:
  args: [{name: service}]
  breakers:
  - {name: p90, max: 1, query: 'histogram_quantile(0.9, rate(x{service="{{args.service}}"}[{{window}}]))'}
  gates:
  - {name: error-rate-delta, max: 0.001, consecutive: 2}
---
apiVersion: graft.dev/v1alpha1
kind: PatchRolout
metadata: {name: typo}
"""


def test_errors_name_the_file_the_document_and_the_field_and_exit_1(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    code, out = lint("-f", path)
    assert code == 1, out
    lines = out.splitlines()
    rollout = f"{path}, document 2 (PatchRollout llm/bad): "
    expected = [
        # the operator's reader (graft.rollout.spec)
        rollout + "spec.steps[1].weight: must be greater than the previous step's weight (50)",
        rollout + "spec.analysis.measurementRetention: must be between 0 and 100",
        rollout + "spec.analysis.breakers[0]: error-rate is a fraction: its limits lie between 0 and 1",
        # and the API server: strict fields, the schema, the CEL rules
        rollout + "spec.colour: unknown field (strict decoding error) (API server)",
        rollout + "spec.analysis.measurementRetention: Invalid value: 101: spec.analysis.measurementRetention in "
                  "body should be less than or equal to 100 (API server)",
        rollout + 'spec.steps: Invalid value: "array": step weights must strictly increase (API server)',
        f"{path}, document 3 (PatchFleet everything): spec.selector: must name the fleet",
        # a template alone, at its own field paths, its argument standing in
        f"{path}, document 4 (PatchAnalysisTemplate llm/slo): spec.breakers[0].query: every vector selector must "
        'carry namespace="{{namespace}}"',
        f"{path}, document 4 (PatchAnalysisTemplate llm/slo): spec.gates[0].consecutive: gates take no consecutive",
        f'{path}, document 4 (PatchAnalysisTemplate llm/slo): spec.gates: Invalid value: "array": gates take no '
        "consecutive: a failing gate holds the step until it passes (API server)",
        f"{path}, document 5 (PatchRolout typo): kind: 'PatchRolout' is not a kind of graft.dev/v1alpha1",
    ]
    for line in expected:
        assert any(found.startswith(line) for found in lines), f"{line}\n---\n{out}"
    assert "left-alone" not in out and "document 1" not in out
    assert lines[-1] == "12 error(s) in 4 of 4 document(s)", out


def test_an_over_long_pause_is_refused_by_the_reader_and_the_api_server_alike(tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "rollout-builtin.yaml").read_text())
    # a pause the duration pattern takes, longer than the 32 characters the model (and so the CRD) allows
    doc["spec"]["steps"] = [{"weight": 50, "pause": "1h" * 17}, {"weight": 100}]
    path = tmp_path / "long-pause.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError, match="must be at most 32 characters"):
        parse_spec(doc["spec"])
    code, out = lint("-f", path)
    assert code == 1 and "spec.steps[0].pause: Too long: may not be longer than 32 (API server)" in out, out
    assert "spec.steps[0].pause: must be at most 32 characters" in out, out
    # without the dev cluster's validator the operator's reader alone decides, and says so
    code, out = lint("-f", path, admission=None)
    assert code == 1 and "spec.steps[0].pause: must be at most 32 characters" in out, out
    assert "not checked against the CRDs' schemas" in out
    code, out = lint("-f", path, admission=lambda folder: None)
    assert code == 1 and "pip install 'graft[devcluster]'" in out, out


def test_stdin_usage_errors_and_unreadable_files(tmp_path, monkeypatch):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO((ROOT / "examples" / "rollout-dry-run.yaml").read_text()))
    code, out = lint("-f", "-")
    assert code == 0 and "-, document 1 (PatchRollout" in out, out
    for argv in ([], ["-f", str(TEMPLATE), "--crds", str(tmp_path / "nowhere")]):
        with pytest.raises(SystemExit) as exit:
            lint(*argv)
        assert exit.value.code == 2
    code, out = lint("-f", tmp_path / "missing.yaml")
    assert code == 1 and "cannot read" in out
    (tmp_path / "broken.yaml").write_text("kind: [PatchRollout\n")
    code, out = lint("-f", tmp_path / "broken.yaml")
    assert code == 1 and "cannot read" in out
    code, out = lint("-f", ROOT / "examples" / "engine-deployment.yaml")
    assert code == 0 and "nothing to check" in out, out


def test_the_crds_of_another_folder(tmp_path):
    crds = tmp_path / "crds"
    crds.mkdir()
    crd = yaml.safe_load((ROOT / "crds" / "patchrollout.yaml").read_text())
    analysis = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["analysis"]
    older = copy.deepcopy(crd)
    del older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["analysis"][
        "properties"]["measurementRetention"]
    assert "measurementRetention" in analysis["properties"]
    (crds / "patchrollout.yaml").write_text(yaml.safe_dump(older))
    # an API server with an older CRD would drop the field: lint against that CRD says so
    code, out = lint("-f", ROOT / "examples" / "rollout-builtin.yaml", "--crds", crds)
    assert code == 0, out
    doc = yaml.safe_load((ROOT / "examples" / "rollout-builtin.yaml").read_text())
    doc["spec"]["analysis"] = {"measurementRetention": 3}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(doc))
    code, out = lint("-f", tmp_path / "r.yaml", "--crds", crds)
    assert code == 1 and "spec.analysis.measurementRetention: unknown field (strict decoding error) (API server)" \
        in out, out
