"""The operator stands alone: importing any part of it loads nothing of the dev cluster, whose
packages (kmock, jsonschema, cel-python) the operator image does not carry."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

IMPORT_ALL = """
import importlib, pkgutil, sys
import graft.operator
for module in pkgutil.walk_packages(graft.operator.__path__, "graft.operator."):
    importlib.import_module(module.name)
print(sorted(m for m in sys.modules if m.startswith(("graft.devcluster", "kmock", "celpy"))))
"""


def test_importing_the_operator_loads_nothing_of_the_dev_cluster():
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_the_operator_extra_carries_nothing_of_the_dev_cluster():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {dep.split(">")[0].split("=")[0].strip() for dep in extras["operator"]}
    assert not names & {"kmock", "jsonschema", "cel-python"}
    assert {"kmock", "jsonschema"} <= {dep.split(">")[0].strip() for dep in extras["devcluster"]}
