"""Placement strategies: a mesh shape plus logical rules, composed with ``+``."""

from jaxlight.strategies.placement import LayoutError
from jaxlight.strategies.rules import (
    BATCH_AXES,
    DEFAULT_RULES,
    MESH_AXES,
    PARAM_FORBIDDEN_AXES,
    normalize_rules,
    override_rules,
    resolve_spec,
)
from jaxlight.strategies.strategy import (
    FILL,
    FSDP,
    STRATEGY_REGISTRY,
    DataParallel,
    Strategy,
    TensorParallel,
    register_strategy,
    resolve_strategy,
)

__all__ = [
    "BATCH_AXES",
    "DEFAULT_RULES",
    "MESH_AXES",
    "PARAM_FORBIDDEN_AXES",
    "FILL",
    "FSDP",
    "LayoutError",
    "DataParallel",
    "Strategy",
    "TensorParallel",
    "STRATEGY_REGISTRY",
    "register_strategy",
    "resolve_strategy",
    "normalize_rules",
    "override_rules",
    "resolve_spec",
]
