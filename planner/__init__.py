"""hetspot planner: pure functions from (cluster, model, train) to a Plan and its Estimate.

Imports only the standard library, pydantic and numpy (tests/test_planner_imports.py).
"""

from planner.contract import PlanContractError
from planner.errors import PlanningError
from planner.estimate import evaluate
from planner.plan_types import Estimate, OffloadPolicy, Pipeline, Plan, Stage, UnusedDevice
from planner.search import plan
from planner.specs import PRESETS, ClusterSpec, ModelSpec, NodeSpec, TrainSpec

__all__ = [
    "PRESETS", "ClusterSpec", "Estimate", "ModelSpec", "NodeSpec", "OffloadPolicy", "Pipeline",
    "Plan", "PlanContractError", "PlanningError", "Stage", "TrainSpec", "UnusedDevice", "evaluate", "plan",
]
