"""Model-side helpers: logical-axis constraints and adapters for models written elsewhere."""

from jaxlight.nn.constrain import axis_rules, constrain
from jaxlight.nn.linen import from_linen

__all__ = ["axis_rules", "constrain", "from_linen"]
