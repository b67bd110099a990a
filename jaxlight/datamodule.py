"""LightningDataModule: the data side of a run in one object."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from jaxlight.hparams import AttributeDict, collect_init_args, select
from jaxlight.module import DataHooks


class LightningDataModule(DataHooks):
    """Groups the dataloaders of a run with their preparation, as in Lightning.

    ``prepare_data`` runs once on process 0, ``setup(stage)`` on every process
    before the loaders are requested, ``teardown(stage)`` after the run. A
    loader is anything re-iterable yielding pytrees of arrays; each yield is a
    global batch. ``val_dataloader`` (and the test/predict ones) may return
    several loaders (a list or a dict), run one after the other with their
    ``dataloader_idx``. ``state_dict``/``load_state_dict`` are saved in
    checkpoints, and so are the hyperparameters ``save_hyperparameters`` records.
    """

    def __init__(self) -> None:
        super().__init__()
        self.trainer: Any = None
        self._hparams: AttributeDict = AttributeDict()
        self._hparams_initial: AttributeDict = AttributeDict()

    # -- hyperparameters (Lightning's HyperparametersMixin) -----------------------------
    def save_hyperparameters(
        self, *args: Any, ignore: Sequence[str] | str | None = None, frame: Any = None, logger: bool = True
    ) -> None:
        """Store ``__init__`` arguments in ``self.hparams``: they are logged with the module's at fit start
        and saved in checkpoints (``datamodule_hyper_parameters``).

        With no arguments every init argument is saved; names select some; a
        dict is saved as given; ``ignore`` drops names.
        """
        ignore = [ignore] if isinstance(ignore, str) else list(ignore or [])
        if len(args) == 1 and isinstance(args[0], Mapping):
            hp = dict(args[0])
        else:
            if frame is None:
                frame = inspect.currentframe().f_back  # type: ignore[union-attr]
            init_args = collect_init_args(frame, ignore)
            hp = select(init_args, args) if args else init_args
        self._hparams = AttributeDict(hp)
        self._hparams_initial = AttributeDict(dict(hp))
        self._log_hyperparams = logger

    @property
    def hparams(self) -> AttributeDict:
        return self.__dict__.get("_hparams", AttributeDict())

    @property
    def hparams_initial(self) -> AttributeDict:
        return self.__dict__.get("_hparams_initial", AttributeDict())

    # -- loaders ------------------------------------------------------------------------
    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define train_dataloader()")

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define test_dataloader()")

    def predict_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define predict_dataloader()")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
