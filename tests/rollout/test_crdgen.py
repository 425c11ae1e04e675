"""The CRDs are generated from the API models (graft.rollout.models) and nothing else: the checked-in
files are what `python -m graft.rollout.crdgen` writes, every property says what it is (`kubectl
explain` prints it), the schemas are structural, and every field the operator writes in a status is
one the schema declares."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from graft.devcluster.crd import check
from graft.rollout import crdgen
from graft.rollout.models import FILES, KINDS
from graft.rollout.status import AnalysisStatus, CheckResult, PodRecord, RolloutStatus

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {crd["spec"]["names"]["kind"]: crd for file in FILES
             for crd in yaml.safe_load_all((ROOT / "crds" / file).read_text())}


@pytest.mark.parametrize("file", list(FILES))
def test_the_checked_in_crds_are_the_generated_ones(file):
    assert (ROOT / "crds" / file).read_text() == crdgen.render(file), (
        f"crds/{file} differs from the models: run python -m graft.rollout.crdgen (make crds)")


def test_the_generator_checks_and_writes(tmp_path, capsys):
    assert crdgen.main(["--check"]) == 0
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)
    (tmp_path / "patchfleet.yaml").write_text("# edited by hand\n")
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 1
    assert "patchfleet.yaml" in capsys.readouterr().err
    # kopf's peering CRDs are kopf's: never written from the models
    assert "kopf-peering.yaml" not in FILES and (ROOT / "crds" / "kopf-peering.yaml").exists()


@pytest.mark.parametrize("kind", [k.kind for k in KINDS])
def test_each_generated_crd_is_one_kube_apiserver_takes(kind):
    crd = GENERATED[kind]
    kubernetes_validate.validate(crd, "1.32", strict=True)
    assert check(crd) == [], "structural schemas, patterns RE2 takes, CEL rules that compile"


def walk(schema: dict[str, Any], path: str, named: bool = True):
    """Every schema under `schema`: (its path, it, whether it is a named property), list items as
    `[]` and map values as `{}` (those are not properties: `kubectl explain` describes their field)."""
    yield path, schema, named
    for name, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]", False)
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}", False)


@pytest.mark.parametrize("kind", [k.kind for k in KINDS])
def test_every_property_has_a_description(kind):
    root = GENERATED[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing = [p for p, s, named in walk(root, kind) if named and not s.get("description")]
    assert missing == [], f"properties without a description: {missing}"
    assert {"spec", "status"} & set(root["properties"]) == ({"spec", "status"} if kind in ("PatchRollout", "PatchFleet")
                                                           else {"spec"})


@pytest.mark.parametrize("kind", [k.kind for k in KINDS])
def test_the_schemas_are_structural(kind):
    """No $ref and no anyOf/oneOf/allOf (a structural schema allows them only as extra checks, and the
    models need none); a type on every node but the step's pause (a duration or {})."""
    root = GENERATED[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, schema, _ in walk(root, kind):
        assert not {"$ref", "$defs", "anyOf", "oneOf", "allOf", "title"} & set(schema), path
        assert "type" in schema or path == "PatchRollout.spec.steps[].pause", path
        assert schema.get("additionalProperties") is not False, path


def declared(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """The paths in `value` that `schema` does not declare."""
    out = []
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in value.items():
            if key not in schema["properties"]:
                out.append(f"{path}.{key}")
            else:
                out += declared(sub, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            out += declared(item, schema["items"], f"{path}[]")
    return out


def a_full_status() -> RolloutStatus:
    """A status with every field the operator writes holding a value."""
    s = RolloutStatus(phase="RollingBack", reason="AnalysisFailed", message="m", patch="kv-align@3.2.1", step_index=1,
                      weight=5, stable_revision="base", canary_revision="kv-align@3.2.1", started_at=1.7e9,
                      step_started_at=1.7e9, step_ready_at=1.7e9, end_phase="RolledBack", cause="error-rate",
                      full_promotion=True, observed_generation=2, awaiting_approval_since=1.7e9,
                      pause_conditions=[{"reason": "InconclusiveLimit", "message": "m", "startTime": "t"}],
                      fleet="llm", stable_patch="kv-align@3.2.0", canary_pods=1, traffic_share=4.5,
                      pods=[PodRecord("p", "u", "c", 1, "canary", "kv-align@3.2.1", 1.7e9)])
    s.analysis = AnalysisStatus(1.7e9, "Failed", [CheckResult("error-rate", "Failed", "<= 0.005", "60s", 0.1, 3, True,
                                                              "too many", "breaker", True, True, {"errors": 9},
                                                              True)],
                                2, 1, 1.7e9, 3.0)
    s.record_analysis(10)
    s.refresh_conditions(1.7e9)
    return s


def test_every_status_field_the_operator_writes_is_declared():
    schema = GENERATED["PatchRollout"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    written = a_full_status().to_dict()
    assert {k for k, v in written.items() if v is None} == set(), "the full status leaves nothing out"
    assert declared(written, schema, "status") == []
    for field in ("stablePatch", "analysisHistory", "awaitingApprovalSince"):
        assert schema["properties"][field]["description"], field
    assert {"inconclusiveRuns", "errorRuns", "outageSince"} <= set(schema["properties"]["analysis"]["properties"])


def test_a_status_reads_back_as_it_was_written():
    s = a_full_status()
    back = RolloutStatus.from_dict(s.to_dict())
    assert back.to_dict() == s.to_dict()
    # all but the sentences the history leaves out (CheckRecord: numbers only)
    assert (back.analysis, back.pods, back.conditions) == (s.analysis, s.pods, s.conditions)
    back.analysis_history = s.analysis_history
    assert back == s
    assert RolloutStatus.from_dict(None) == RolloutStatus()


def test_a_new_field_is_one_declaration():
    """What later fields (webhooks, notifications, metric providers) take: declared once on a model,
    the field is in the generated schema with its description and bounds, defaulted and refused by
    the reader at the API server's path."""
    from typing import Annotated

    from pydantic import Field

    from graft.rollout.models.base import validate
    from graft.rollout.models.patchrollout import PatchRolloutSpec

    class WithWebhook(PatchRolloutSpec):
        webhook_timeout: Annotated[int, Field(ge=1, le=60)] = Field(
            default=10, description="Seconds a webhook may take before its answer counts as a failure.")

    schema = crdgen.model_schema(WithWebhook)["properties"]["webhookTimeout"]
    assert schema == {"description": "Seconds a webhook may take before its answer counts as a failure.",
                      "type": "integer", "default": 10, "maximum": 60, "minimum": 1}
    base = {"selector": {"matchLabels": {"app": "llm"}}, "patch": {"name": "kv-align", "version": "1"}}
    assert validate(WithWebhook, base, "spec")[0].webhook_timeout == 10
    _, errors = validate(WithWebhook, {**base, "webhookTimeout": 90}, "spec")
    assert [str(e) for e in errors] == ["spec.webhookTimeout: must be between 1 and 60"]
