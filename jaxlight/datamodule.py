"""LightningDataModule: the data side of a run in one object."""

from __future__ import annotations

from typing import Any

from jaxlight.hparams import AttributeDict, HyperparametersMixin
from jaxlight.module import DataHooks


class LightningDataModule(HyperparametersMixin, DataHooks):
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
