"""How this process serves, decided once from the settings: ``plan_serving(settings)`` gives
the frozen ``ServingPlan`` (devices, workers and threads, where uploads are decoded, in-process
or broker mode, the batching limits) that every other piece receives."""

from app.plan.decode import DecodePlan
from app.plan.serving import (
    BrokerPlan,
    CachePlan,
    Limits,
    Placement,
    RepositoryPlan,
    Role,
    ServingPlan,
    WorkerConfig,
    plan_serving,
    plan_workers,
)

__all__ = [
    "BrokerPlan",
    "CachePlan",
    "DecodePlan",
    "Limits",
    "Placement",
    "RepositoryPlan",
    "Role",
    "ServingPlan",
    "WorkerConfig",
    "plan_serving",
    "plan_workers",
]
