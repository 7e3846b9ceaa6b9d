"""Errors the planner raises for inputs it cannot plan (user errors, not bugs)."""


class PlanningError(ValueError):
    """No plan exists for the given cluster, model and training spec; the message says why and what to change."""
