"""EMA: an exponential moving average of the parameters, kept inside the compiled train step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxlight.callbacks.callback import Callback
from jaxlight.rank_zero import rank_zero_warn
from jaxlight.step import StepExtension
from jaxlight.step_info import StepInfo


def ema_update(
    ema: dict[str, jax.Array],
    params: dict[str, jax.Array],
    step: Any,
    updated: Any,
    decay: float,
    warmup: bool,
    every: int,
) -> dict[str, jax.Array]:
    """One EMA update of ``ema`` towards ``params``, at optimizer step ``step`` (after the update, so 1 for the
    first), applied when ``updated`` and ``step`` is a multiple of ``every``; traceable (the train step runs it).

    Arithmetic in float32 (float64 kept); each average keeps its dtype; a skipped update keeps the stored
    value exactly, a non-finite one included.
    """
    do = updated & (step % every == 0)
    d = jnp.where(do, ema_decay(decay, step, warmup), jnp.float32(1.0))

    def one(e: jax.Array, p: jax.Array) -> jax.Array:
        acc = jnp.promote_types(e.dtype, jnp.float32)
        new = d.astype(acc) * e.astype(acc) + (1 - d.astype(acc)) * p.astype(acc)
        # d == 1 keeps the stored value exactly (also a non-finite one)
        return jnp.where(do, new.astype(e.dtype), e)

    return {k: one(ema[k], params[k]) for k in ema}


def ema_decay(decay: float, step: Any, warmup: bool) -> Any:
    """The decay used for the EMA update made at optimizer step ``step`` (1 for the first update).

    With ``warmup`` the decay is ``min(decay, (1 + step) / (10 + step))``: the
    average forgets its random initial value quickly during the first steps
    (0.18 at step 1, 0.5 at step 8, 0.9 at step 80) and settles at ``decay``.
    """
    if not warmup:
        return jnp.float32(decay)
    t = jnp.asarray(step, jnp.float32)
    return jnp.minimum(jnp.float32(decay), (1.0 + t) / (10.0 + t))


class EMA(Callback):
    """Keeps ``ema = d * ema + (1 - d) * params`` updated inside the compiled train step.

    Guarantees: the average is updated on the device after the optimizer
    update, with no host round trip; only real optimizer steps count (not
    micro-batches inside gradient accumulation, not updates a non-finite guard
    skipped), and only every ``every_n_steps``-th of them (the optimizer step
    count ``t`` is the device's ``TrainState.step`` after the update, so the
    first update is ``t = 1``). The decay is ``d = decay``, or with ``warmup``
    ``d = min(decay, (1 + t) / (10 + t))``. Arithmetic is in float32 (float64
    kept), the stored average keeps each parameter's dtype and sharding, and
    it lives in ``TrainState.callback_state["ema"]``, so checkpoints save and restore it
    with the train state. With ``use_for_validation`` the validation loop inside
    ``fit`` and ``validate``/``test`` after it evaluate the EMA weights; the
    module itself keeps the trained weights (read the average with
    :meth:`ema_params`).
    """

    def __init__(
        self,
        decay: float = 0.999,
        warmup: bool = True,
        every_n_steps: int = 1,
        use_for_validation: bool = True,
        name: str = "ema",
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"EMA every_n_steps must be an int >= 1, got {every_n_steps!r}")
        self.decay = float(decay)
        self.warmup = bool(warmup)
        self.every_n_steps = every_n_steps
        self.use_for_validation = use_for_validation
        self.name = name

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)

    # -- in-step state
    def step_extension(self, trainer: Any) -> StepExtension:
        decay, warmup, every = self.decay, self.warmup, self.every_n_steps

        def update(ema: dict[str, jax.Array], params: dict[str, jax.Array], info: dict[str, Any]) -> dict:
            return ema_update(ema, params, info["step"], info["updated"], decay, warmup, every)

        return StepExtension(self.name, update)

    def init_step_state(self, trainer: Any, params: dict[str, jax.Array]) -> dict[str, jax.Array]:
        # A copy (the train state is donated, so the average must not share buffers with the parameters),
        # created with the parameters' own shardings.
        shardings = {k: v.sharding for k, v in params.items()}
        return jax.jit(lambda p: {k: jnp.copy(v) for k, v in p.items()}, out_shardings=shardings)(params)

    # -- the logic on a StepInfo (no Trainer)
    def next_average(self, average: dict[str, jax.Array], info: StepInfo) -> dict[str, jax.Array]:
        """``average`` after the optimizer update that produced ``info.state``, by the compiled step's own
        arithmetic (:func:`ema_update`): towards ``info.state.params`` at the step count ``info.state.step``,
        applied when ``info.stepped`` (the update happened)."""
        state = info.state
        if state is None:
            raise RuntimeError("EMA.next_average needs a StepInfo with a train state (info.state is None)")
        step, every = state.step, self.every_n_steps
        return ema_update(average, state.params, step, info.stepped, self.decay, self.warmup, every)

    def average(self, info: StepInfo) -> dict[str, jax.Array]:
        """The averaged parameters in ``info.state`` (flat ``{path: array}``, sharded like the parameters)."""
        state = info.state
        if state is None or self.name not in state.callback_state:
            raise RuntimeError("EMA has no average yet: it is created when fit() sets up training")
        return state.callback_state[self.name]

    def weights_to_evaluate(self, info: StepInfo) -> dict[str, jax.Array] | None:
        """The average when validation should evaluate it (``use_for_validation`` and a state exists)."""
        if not self.use_for_validation or info.state is None:
            return None
        return info.state.callback_state.get(self.name)

    # -- Lightning-style adapters
    def ema_params(self, trainer: Any) -> dict[str, jax.Array]:
        """The averaged parameters (flat ``{path: array}``, sharded like the parameters), from a Trainer or a
        :class:`~jaxlight.step_info.StepInfo`."""
        return self.average(trainer if isinstance(trainer, StepInfo) else StepInfo.of_trainer(trainer))

    def eval_params(self, trainer: Any, params: dict[str, jax.Array]) -> dict[str, jax.Array] | None:
        return self.weights_to_evaluate(StepInfo.of_trainer(trainer))

    def state_dict(self) -> dict[str, Any]:
        # The average itself is device state in TrainState.callback_state; this is the configuration it was made with.
        return {"decay": self.decay, "warmup": self.warmup, "every_n_steps": self.every_n_steps, "name": self.name}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {k: state_dict[k] for k in ("decay", "warmup", "every_n_steps") if k in state_dict}
        mine = {"decay": self.decay, "warmup": self.warmup, "every_n_steps": self.every_n_steps}
        changed = {k: (v, mine[k]) for k, v in saved.items() if v != mine[k]}
        if changed:
            rank_zero_warn(f"EMA: the checkpoint's average was made with {saved}; continuing with {mine}")
