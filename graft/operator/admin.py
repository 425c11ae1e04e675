"""The engines' admin API client, for the operator: it lives in graft.adminapi (shared with the
engine's models, the benches and the demo); these names stay importable from here."""
from graft.adminapi.client import AdminCall, AdminClient, AdminError, EngineAnswer

__all__ = ["AdminCall", "AdminClient", "AdminError", "EngineAnswer"]
