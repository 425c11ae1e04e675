"""Fixtures shared by the dev cluster tests: a bare API server emulator and an HTTP client on it.

A module that needs the emulator with CRDs of its own (test_admission, test_apiserver) defines its
own `api`, which takes precedence over this one.
"""
import httpx
import pytest

from graft.devcluster.apiserver import ApiServer


@pytest.fixture
async def api():
    """The emulator with its built-in kinds only; a test fails if the emulator failed on its own
    (an exception in a handler), even where the client saw a well-formed answer."""
    async with ApiServer() as server:
        yield server
        assert not server.errors, f"the emulator failed on its own: {server.errors}"


@pytest.fixture
async def client(api):
    async with httpx.AsyncClient(base_url=api.url) as http:
        yield http
