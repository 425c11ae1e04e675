import pytest

from rollout_fleet import make_spec


@pytest.fixture
def spec():
    return make_spec()
