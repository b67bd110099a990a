"""``Remat``: rematerialise the layers of every LayerStack whose ``remat`` the user left unset.

A strategy piece with no mesh axes (``"ddp+remat"``, ``"fsdp+remat"``): while the steps are traced,
a :class:`jaxlight.nn.LayerStack` built with ``remat=None`` runs its layer body under this piece's
``jax.checkpoint`` policy, so the backward pass recomputes each layer's intermediates from its input
instead of keeping them (less activation memory, one more forward pass of the stack in FLOPs). A stack
whose ``remat`` the user set, to a policy or to anything else, keeps it: the piece never overrides a
user's choice. ``strategy="auto"`` (:mod:`jaxlight.planner`) compiles these variants before host
offload and picks one when it fits and is estimated faster; its printed plan says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import ClassVar

from jax.sharding import Mesh

from jaxlight.strategies.pipeline import RematPolicy, remat_policy
from jaxlight.strategies.strategy import Piece, register_strategy

__all__ = ["Remat", "counting_unset_remat", "unset_remat"]

_local = threading.local()


@dataclasses.dataclass(frozen=True)
class Remat(Piece):
    """Rematerialise every ``LayerStack(remat=None)`` with ``policy`` (a name of
    :data:`jaxlight.strategies.pipeline.REMAT_POLICIES` or a ``jax.checkpoint_policies`` object).

    Guarantees: values are those of the same step without it (rematerialisation recomputes, it does
    not change what is computed); stacks with an explicit ``remat`` are left as the user built them.
    """

    name: ClassVar[str] = "remat"
    policy: RematPolicy = "full"

    def __post_init__(self) -> None:
        if self.policy is None:
            raise ValueError("Remat(policy=None) would rematerialise nothing; leave the piece out instead")
        remat_policy(self.policy)  # an unknown policy fails here, not at the first step

    def trace_context(self, mesh: Mesh) -> contextlib.AbstractContextManager:
        return _default_remat(self.policy)


@contextlib.contextmanager
def _default_remat(policy: RematPolicy) -> Iterator[None]:
    prev = getattr(_local, "policy", None)
    _local.policy = policy
    try:
        yield
    finally:
        _local.policy = prev


def unset_remat() -> RematPolicy:
    """The policy a LayerStack built with ``remat=None`` runs under now: the active :class:`Remat` piece's,
    else None. Each call is counted by an enclosing :func:`counting_unset_remat`."""
    seen = getattr(_local, "seen", None)
    if seen is not None:
        seen.append(True)
    return getattr(_local, "policy", None)


@contextlib.contextmanager
def counting_unset_remat() -> Iterator[list]:
    """A list that grows by one per LayerStack call with ``remat=None`` traced inside (what a :class:`Remat`
    piece would change: empty means the piece is a no-op for this model)."""
    prev = getattr(_local, "seen", None)
    _local.seen = seen = []
    try:
        yield seen
    finally:
        _local.seen = prev


register_strategy("remat", Remat)
