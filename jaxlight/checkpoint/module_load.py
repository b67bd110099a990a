"""``LightningModule.load_from_checkpoint``: a module rebuilt from a checkpoint, without a Trainer."""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any

import jax

from jaxlight.checkpoint.discovery import check_path
from jaxlight.checkpoint.format import abstract, drop_unsaved_state, read_meta, restore_arrays
from jaxlight.checkpoint.host_state import host_checkpoint
from jaxlight.errors import CheckpointError
from jaxlight.state import holder_keys, merge_models, nnx_attributes, nnx_objects, split_models

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.module import LightningModule


def _init_kwargs(cls: type, hparams: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's hparams that ``cls.__init__`` takes (all of them if it takes ``**kwargs``), overridden."""
    sig = inspect.signature(cls.__init__)
    if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        hparams = {k: v for k, v in hparams.items() if k in sig.parameters}
    return {**hparams, **overrides}


def load_module_from_checkpoint(
    cls: type[LightningModule], checkpoint_path: str | os.PathLike, **kwargs: Any
) -> LightningModule:
    """Rebuild a module from a checkpoint's hparams (``kwargs`` override them) and load its weights.

    No trainer is needed: ``configure_model`` runs when ``__init__`` created no
    NNX attribute, and the arrays land on the default device.
    """
    from flax import nnx

    path = check_path(checkpoint_path)
    meta = read_meta(path)
    ckpt = host_checkpoint(meta, path)
    hp = _init_kwargs(cls, dict(ckpt.get("hyper_parameters") or {}), kwargs)
    # Logical sharding annotations stay metadata here: no mesh, the default device.
    with nnx.use_eager_sharding(False):
        module = cls(**hp)
        if not nnx_attributes(module):
            module.configure_model()
    if not nnx_attributes(module):
        raise CheckpointError(
            f"{cls.__name__} created no flax.nnx.Module attribute in __init__ or configure_model; "
            f"there is nothing to load the checkpoint into"
        )
    parts, params, rest = split_models(nnx_objects(module))  # its models and the NNX objects beside them

    def sharding(x: Any) -> Any:
        return getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])

    targets = {
        "model": {
            g: {k: abstract(v, sharding(v)) for k, v in d.items()} for g, d in (("params", params), ("rest", rest)) if d
        }
    }
    unsaved = drop_unsaved_state(path, targets, holder_keys(parts))
    arrays = restore_arrays(path, targets, meta.get("key_impls", {}))["model"]
    rest = {**arrays.get("rest", {}), **{k: rest[k] for k in unsaved}}  # unsaved: kept as built
    new = merge_models(parts, arrays.get("params", {}), rest, train=True)
    for k, m in new.items():
        object.__setattr__(module, k, m)
    module.on_load_checkpoint(ckpt)
    return module


__all__ = ["load_module_from_checkpoint"]
