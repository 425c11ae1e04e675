from __future__ import annotations

import helm_python as helm
import pytest

from tests.deploy.manifests import CHART, crd_versions


@pytest.fixture(scope="session")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def crds():
    return crd_versions()
