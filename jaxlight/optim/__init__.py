"""Optimizers: from what ``configure_optimizers`` returns to the optax transformation the step applies.

* :mod:`~jaxlight.optim.configure`: the return forms, :class:`OptimizerConfig` and its ``build``;
* :mod:`~jaxlight.optim.params`: parameter selectors, :func:`param_groups`, partitions;
* :mod:`~jaxlight.optim.schedules`: scheduler configs, the injected learning rate, plateau schedulers;
* :mod:`~jaxlight.optim.accumulate`: gradient accumulation (:class:`AccumulationState`);
* :mod:`~jaxlight.optim.inspect`: names and current hyperparameters, read from the optax *state*.
"""

from jaxlight.optim.accumulate import AccumulationState, accumulate_gradients
from jaxlight.optim.configure import BuiltOptimizer, OptimizerConfig, OptimizerEntry, configure
from jaxlight.optim.inspect import GroupInfo, TransformInfo, inspect_transform
from jaxlight.optim.params import FROZEN, KnownGroup, ParamGroups, param_groups, select_params
from jaxlight.optim.schedules import (
    SchedulerConfig,
    drive_learning_rate,
    hold_plateaus,
    is_injected_state,
    is_plateau,
    is_plateau_state,
    plateau_stepper,
)

__all__ = [
    "FROZEN",
    "AccumulationState",
    "BuiltOptimizer",
    "GroupInfo",
    "KnownGroup",
    "OptimizerConfig",
    "OptimizerEntry",
    "ParamGroups",
    "SchedulerConfig",
    "TransformInfo",
    "accumulate_gradients",
    "configure",
    "drive_learning_rate",
    "hold_plateaus",
    "inspect_transform",
    "is_injected_state",
    "is_plateau",
    "is_plateau_state",
    "param_groups",
    "plateau_stepper",
    "select_params",
]
