"""The operator's one family of errors that stop a rollout from acting, each carrying its Problem.

A `ProblemError` is never about one pod (those are `AdminError` and `pods.AddressError`, which
become a pod's `PodError`): it is something outside the pods, a missing Secret or a bundle that
cannot be sent, and the rollout reports its `problem` (reason, message, and whether it is
permanent) as it is.
"""
from __future__ import annotations

from graft.rollout.observation import Problem


class ProblemError(Exception):
    """Something outside the pods stops the rollout from acting; `problem` says what, for its status."""

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem


class TokenError(ProblemError):
    """The engines' admin token cannot be read (its Secret is missing or lacks its key)."""


class SecretError(ProblemError):
    """A Secret a rollout names (Prometheus credentials) is missing or lacks its key."""


class PrometheusRefused(ProblemError):
    """The Prometheus a rollout names is not one the operator may ask, or its Secrets not ones it may read."""


class BundleError(ProblemError):
    """A patch bundle cannot be sent: its ConfigMap or key is missing, or its digest is not the pinned one."""
