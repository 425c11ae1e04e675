"""The engines' admin API, shared by its server and its clients (docs/architecture.md, "Admin API").

`graft.adminapi.models`: the request and answer bodies as pydantic models; the engine validates
requests with them (graft.engine.admin). `graft.adminapi.client`: the async client the operator,
the benches and the demo call engines with. Neither imports the engine or the operator: the
operator image (no torch) imports this package, and so does the engine.
"""
from graft.adminapi.client import AdminCall, AdminClient, AdminError, EngineAnswer
from graft.adminapi.models import AppliedPatch, ApplyAnswer, ApplyRequest, PatchesAnswer, RevertAnswer

__all__ = ["AdminCall", "AdminClient", "AdminError", "EngineAnswer", "AppliedPatch", "ApplyAnswer", "ApplyRequest",
           "PatchesAnswer", "RevertAnswer"]
