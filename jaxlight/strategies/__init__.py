"""Placement strategies: small immutable pieces (mesh axes, rules, batch splits, memory kinds, in-step
wrappers, trace contexts) composed with ``+`` into a :class:`Strategy`.

``strategy="auto"`` is not here: choosing a layout compiles candidates through the engine, which sits
above this package, so the planner is :mod:`jaxlight.planner` (``AutoStrategy``, ``choose_strategy``,
``NoStrategyFits``)."""

from jaxlight.strategies.expert import ExpertParallel
from jaxlight.strategies.offload import HostOffload
from jaxlight.strategies.pipeline import PipelineParallel
from jaxlight.strategies.placement import LayoutError
from jaxlight.strategies.remat import Remat
from jaxlight.strategies.rules import (
    BATCH_AXES,
    DEFAULT_RULES,
    MESH_AXES,
    PARAM_FORBIDDEN_AXES,
    normalize_rules,
    override_rules,
    resolve_spec,
)
from jaxlight.strategies.sequence import SequenceParallel
from jaxlight.strategies.strategy import (
    FILL,
    FSDP,
    STRATEGY_REGISTRY,
    CompositionError,
    DataParallel,
    Layout,
    Piece,
    Strategy,
    TensorParallel,
    register_strategy,
    resolve_strategy,
)

__all__ = [
    "BATCH_AXES",
    "DEFAULT_RULES",
    "FILL",
    "FSDP",
    "HostOffload",
    "MESH_AXES",
    "PARAM_FORBIDDEN_AXES",
    "STRATEGY_REGISTRY",
    "CompositionError",
    "DataParallel",
    "ExpertParallel",
    "Layout",
    "LayoutError",
    "Piece",
    "PipelineParallel",
    "Remat",
    "SequenceParallel",
    "Strategy",
    "TensorParallel",
    "normalize_rules",
    "override_rules",
    "register_strategy",
    "resolve_spec",
    "resolve_strategy",
]
