"""TQDMProgressBar: a tqdm bar per stage with it/s and the prog_bar metrics."""

from __future__ import annotations

import sys
from typing import Any

from jaxlight.callbacks.callback import Callback


class TQDMProgressBar(Callback):
    """Shows training, validation, test and predict progress with tqdm.

    The counter advances every ``refresh_rate`` batches; metrics logged with
    ``prog_bar=True`` appear in the postfix as soon as the trainer fetches
    them (every ``log_every_n_steps`` and at epoch end), so the bar itself
    never forces a device sync. Draws on process 0 only.
    """

    def __init__(self, refresh_rate: int = 1, leave: bool = False, file: Any = None) -> None:
        if refresh_rate < 0:
            raise ValueError(f"refresh_rate must be >= 0, got {refresh_rate}")
        self.refresh_rate = refresh_rate
        self.leave = leave
        self.file = file
        self._bars: dict[str, Any] = {}
        self._seen: dict[str, int] = {}
        self._shown_metrics: dict[str, float] | None = None

    @property
    def is_enabled(self) -> bool:
        return self.refresh_rate > 0

    def _new(self, trainer: Any, key: str, desc: str, total: Any, leave: bool) -> None:
        if not self.is_enabled or not trainer.is_global_zero:
            return
        from tqdm.auto import tqdm

        if isinstance(total, (list, tuple)):  # several evaluation loaders: one bar over all of them
            total = sum(total)
        if total is not None and total == float("inf"):
            total = None

        self._close(key)
        self._seen[key] = 0
        self._bars[key] = tqdm(
            total=total,
            desc=desc,
            leave=leave,
            dynamic_ncols=True,
            file=self.file or sys.stderr,
            position=0 if key == "train" else 1,
            smoothing=0.1,
        )
        self._shown_metrics = None

    def _advance(self, trainer: Any, key: str, batch_idx: int) -> None:
        bar = self._bars.get(key)
        if bar is None:
            return
        # batches shown so far: batch_idx restarts with each evaluation loader, so count them instead
        self._seen[key] = n = max(self._seen.get(key, 0) + 1, batch_idx + 1) if key != "train" else batch_idx + 1
        if n % self.refresh_rate == 0 or (bar.total is not None and n >= bar.total):
            bar.update(n - bar.n)
            if key == "train":
                self._postfix(trainer, bar)

    def _postfix(self, trainer: Any, bar: Any) -> None:
        metrics = trainer.progress_bar_metrics
        if metrics != self._shown_metrics:
            self._shown_metrics = dict(metrics)
            bar.set_postfix({k: f"{v:.4g}" for k, v in metrics.items()}, refresh=False)

    def _close(self, key: str) -> None:
        bar = self._bars.pop(key, None)
        if bar is not None:
            bar.close()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._new(trainer, "train", f"Epoch {trainer.current_epoch}", trainer.num_training_batches, leave=self.leave)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._advance(trainer, "train", batch_idx)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        bar = self._bars.get("train")
        if bar is not None:
            self._postfix(trainer, bar)
            bar.refresh()

    def on_train_end(self, trainer, pl_module) -> None:
        self._close("train")

    def on_validation_start(self, trainer, pl_module) -> None:
        desc = "Sanity Checking" if trainer.sanity_checking else "Validation"
        self._new(trainer, "val", desc, trainer.num_val_batches, leave=False)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._advance(trainer, "val", batch_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._close("val")
        bar = self._bars.get("train")
        if bar is not None:
            self._postfix(trainer, bar)

    def on_test_start(self, trainer, pl_module) -> None:
        self._new(trainer, "test", "Testing", trainer.num_test_batches, leave=True)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._advance(trainer, "test", batch_idx)

    def on_test_end(self, trainer, pl_module) -> None:
        self._close("test")

    def on_predict_start(self, trainer, pl_module) -> None:
        self._new(trainer, "predict", "Predicting", trainer.num_predict_batches, leave=True)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._advance(trainer, "predict", batch_idx)

    def on_predict_end(self, trainer, pl_module) -> None:
        self._close("predict")

    def on_exception(self, trainer, pl_module, exception) -> None:
        for k in list(self._bars):
            self._close(k)
