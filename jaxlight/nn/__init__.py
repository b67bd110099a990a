"""Model-side helpers: logical-axis constraints and adapters for models written elsewhere."""

from jaxlight.nn.attention import attention
from jaxlight.nn.constrain import axis_rules, constrain
from jaxlight.nn.equinox import EquinoxBuffer, EquinoxModule, EquinoxState, from_equinox
from jaxlight.nn.layer_stack import LayerStack
from jaxlight.nn.linen import LinenModule, from_linen
from jaxlight.nn.moe import MoE
from jaxlight.nn.variables import VariablesMismatchError, load_variables

__all__ = [
    "LayerStack",
    "MoE",
    "attention",
    "axis_rules",
    "constrain",
    "from_linen",
    "LinenModule",
    "from_equinox",
    "EquinoxModule",
    "EquinoxState",
    "EquinoxBuffer",
    "load_variables",
    "VariablesMismatchError",
]
