"""Graft: hot patches for a running LLM inference fleet."""
