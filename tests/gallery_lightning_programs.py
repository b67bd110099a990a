"""The second differential gallery (issue 23): five programs in the style of Lightning's own examples, each
written twice, for pytorch-lightning and for jaxlight, tiny enough for a CPU.

Written after ``basics/backbone_image_classifier.py`` (LightningCLI, a ragged split), ``basics/autoencoder.py``
(LightningCLI, an image callback), ``domain_templates/generative_adversarial_net.py`` (manual optimization,
``training_step(self, batch)``), ``basics/transformer.py`` with Lightning's demo Transformer (gradient
clipping) and ``domain_templates/computer_vision_fine_tuning.py`` (``BaseFinetuning``, ``MultiStepLR``,
LightningCLI with linked arguments). Each jaxlight port keeps the original's structure; the lines it had to
change are marked ``# port:``. Each ``run_*`` function trains one framework's version from the same initial
torch weights (the Lightning run writes them, the port loads them with ``load_torch_weights``) on the same
batches of the same torch loaders, and returns what a user sees, as plain Python data
(``tests/test_gallery_lightning.py`` compares the two).
"""

import glob
import os
from typing import Any

import numpy as np

STEPS = 10  # losses compared for the first STEPS optimizer steps


def _quiet_lightning() -> None:
    import logging
    import warnings

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="pytorch_lightning")
    warnings.filterwarnings("ignore", module="lightning_fabric")
    warnings.filterwarnings("ignore", module="torch")


def _ckpt_names(root: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "**", "*.ckpt"), recursive=True))


def _f(x: Any) -> float:
    return float(np.asarray(x.detach() if hasattr(x, "detach") else x))


# ============================================================================ shared pieces
PIXELS = 8  # 8x8 "digits"


def digits(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-like data: 1x8x8 images in [0, 1] whose bright pixel pattern depends on the label (NCHW)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, rows)
    x = 0.2 * rng.random((rows, 1, PIXELS, PIXELS))
    for i, label in enumerate(y):
        x[i, 0, label % PIXELS, :] += 0.6
        x[i, 0, :, (label * 3) % PIXELS] += 0.4
    return np.clip(x, 0, 1).astype(np.float32), y.astype(np.int64)


def image_grid(images: np.ndarray, nrow: int = 8, padding: int = 2) -> np.ndarray:
    """Images ``(N, H, W)`` tiled into one ``(rows*(H+p)+p, nrow*(W+p)+p)`` array, scaled to [0, 1] (what
    torchvision's ``make_grid(normalize=True)`` does, which this machine lacks)."""
    n, h, w = images.shape
    rows = -(-n // nrow)
    grid = np.zeros((rows * (h + padding) + padding, min(n, nrow) * (w + padding) + padding), np.float32)
    lo, hi = float(images.min()), float(images.max())
    images = (images - lo) / max(hi - lo, 1e-5)
    for i, img in enumerate(images):
        r, c = divmod(i, nrow)
        grid[padding + r * (h + padding) :][:h, padding + c * (w + padding) :][:, :w] = img
    return grid


def save_image(grid: np.ndarray, path: str) -> None:
    from PIL import Image

    Image.fromarray((grid * 255).round().astype(np.uint8)).save(path)


def read_image(path: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path), np.int32)


def _recorder(framework: str, rec: dict[str, Any], keys: tuple[str, ...] = ()) -> Any:
    """A callback recording each step's loss (``outputs["loss"]``, or the logged ``keys``), each
    validation's ``callback_metrics`` and the metric names (the same class body for both frameworks)."""
    if framework == "pl":
        import pytorch_lightning as pl

        base = pl.Callback
    else:
        import jaxlight as jl

        base = jl.Callback
    rec.setdefault("losses", [])
    rec.setdefault("val", [])

    class Record(base):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if keys:
                rec["losses"].append(tuple(_f(trainer.callback_metrics[k]) for k in keys))
            else:
                rec["losses"].append(_f(outputs["loss"]))

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                rec["val"].append({k: _f(v) for k, v in trainer.callback_metrics.items() if "val" in k})

    return Record()


def _fitted(rec: dict[str, Any], trainer: Any) -> None:
    """What fit leaves behind, read before evaluation replaces the metrics."""
    rec["metric_names"] = sorted(trainer.callback_metrics)
    rec["current_epoch"], rec["global_step"] = trainer.current_epoch, trainer.global_step


def _finish(rec: dict[str, Any], trainer: Any, root: str, framework: str) -> dict[str, Any]:
    rec.update(
        checkpoints=_ckpt_names(root),
        compile_counts=dict(trainer.compile_counts) if framework == "jl" else None,
    )
    return rec


def _cli_kwargs(framework: str) -> dict[str, Any]:
    return {"trainer_defaults": {"accelerator": "cpu", "devices": 1}} if framework == "pl" else {}


# ============================================================================ 1. image classifier (LightningCLI)
def _classifier_lightning():
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset, random_split

    class Backbone(torch.nn.Module):
        def __init__(self, hidden_dim: int = 16):
            super().__init__()
            self.l1 = torch.nn.Linear(PIXELS * PIXELS, hidden_dim)
            self.l2 = torch.nn.Linear(hidden_dim, 10)

        def forward(self, x):
            x = x.view(x.size(0), -1)
            x = torch.relu(self.l1(x))
            return torch.relu(self.l2(x))

    class LitClassifier(pl.LightningModule):
        def __init__(self, backbone: Backbone | None = None, learning_rate: float = 1e-2, init_weights: str = ""):
            super().__init__()
            self.save_hyperparameters(ignore=["backbone"])
            if backbone is None:
                backbone = Backbone()
            self.backbone = backbone
            if init_weights:
                torch.save(self.state_dict(), init_weights)  # the initial weights, for the port

        def forward(self, x):
            return self.backbone(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            y_hat = self(x)
            loss = F.cross_entropy(y_hat, y)
            self.log("train_loss", loss, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            y_hat = self(x)
            loss = F.cross_entropy(y_hat, y)
            self.log("valid_loss", loss, on_step=True)

        def test_step(self, batch, batch_idx):
            x, y = batch
            y_hat = self(x)
            loss = F.cross_entropy(y_hat, y)
            self.log("test_loss", loss)

        def predict_step(self, batch, batch_idx, dataloader_idx=None):
            x, y = batch
            return self(x)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    class MyDataModule(pl.LightningDataModule):
        def __init__(self, batch_size: int = 32):
            super().__init__()
            dataset = TensorDataset(*map(torch.from_numpy, digits(120, seed=3)))
            self.mnist_test = TensorDataset(*map(torch.from_numpy, digits(24, seed=4)))
            self.mnist_train, self.mnist_val = random_split(
                dataset, [100, 20], generator=torch.Generator().manual_seed(42)
            )
            self.batch_size = batch_size

        def train_dataloader(self):
            return DataLoader(self.mnist_train, batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(self.mnist_val, batch_size=self.batch_size)

        def test_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

        def predict_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

    return LitClassifier, MyDataModule


def _classifier_jaxlight():
    import jax.numpy as jnp
    import optax
    import torch
    from flax import nnx
    from torch.utils.data import DataLoader, TensorDataset, random_split

    import jaxlight as jl
    from jaxlight.migrate import load_torch_weights

    class Backbone(nnx.Module):  # port: an NNX module, its keys explicit
        def __init__(self, hidden_dim: int = 16, seed: int = 0):
            rngs = nnx.Rngs(seed)
            self.l1 = nnx.Linear(PIXELS * PIXELS, hidden_dim, rngs=rngs)
            self.l2 = nnx.Linear(hidden_dim, 10, rngs=rngs)

        def __call__(self, x):
            x = x.reshape(x.shape[0], -1)
            x = nnx.relu(self.l1(x))
            return nnx.relu(self.l2(x))

    class LitClassifier(jl.LightningModule):
        def __init__(self, backbone: Backbone | None = None, learning_rate: float = 1e-2, init_weights: str = ""):
            super().__init__()
            self.save_hyperparameters(ignore=["backbone"])
            if backbone is None:
                backbone = Backbone()
            self.backbone = backbone

        def on_fit_start(self):
            if self.hparams.init_weights:  # port: start from the original's torch weights
                load_torch_weights(self, self.hparams.init_weights)

        def forward(self, x):
            return self.backbone(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            y_hat = self(x)
            loss = optax.softmax_cross_entropy_with_integer_labels(y_hat, y).mean()  # port: optax's loss
            self.log("train_loss", loss, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            y_hat = self(x)
            loss = optax.softmax_cross_entropy_with_integer_labels(y_hat, y).mean()
            self.log("valid_loss", loss, on_step=True)

        def test_step(self, batch, batch_idx):
            x, y = batch
            y_hat = self(x)
            loss = optax.softmax_cross_entropy_with_integer_labels(y_hat, y).mean()
            self.log("test_loss", loss)

        def predict_step(self, batch, batch_idx, dataloader_idx=None):
            x, y = batch
            return self(x)

        def configure_optimizers(self):
            return optax.adam(self.hparams.learning_rate)  # port: optax's Adam

    class MyDataModule(jl.LightningDataModule):
        def __init__(self, batch_size: int = 32):
            super().__init__()
            dataset = TensorDataset(*map(torch.from_numpy, digits(120, seed=3)))
            self.mnist_test = TensorDataset(*map(torch.from_numpy, digits(24, seed=4)))
            self.mnist_train, self.mnist_val = random_split(
                dataset, [100, 20], generator=torch.Generator().manual_seed(42)
            )
            self.batch_size = batch_size

        def train_dataloader(self):
            return DataLoader(self.mnist_train, batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(self.mnist_val, batch_size=self.batch_size)

        def test_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

        def predict_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

    del jnp
    return LitClassifier, MyDataModule


def run_classifier(framework: str, root: str, init: str, max_epochs: int = 3) -> dict[str, Any]:
    """backbone_image_classifier.py's ``cli_main``: fit, test and predict from the best checkpoint."""
    if framework == "pl":
        _quiet_lightning()
        from pytorch_lightning.cli import LightningCLI

        Model, Data = _classifier_lightning()
    else:
        from jaxlight.cli import LightningCLI

        Model, Data = _classifier_jaxlight()
    args = [
        f"--trainer.default_root_dir={root}",
        f"--trainer.max_epochs={max_epochs}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.log_every_n_steps=2",
        f"--model.init_weights={init}",
    ]
    cli = LightningCLI(
        Model,
        Data,
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        run=False,
        args=args,
        **_cli_kwargs(framework),
    )
    rec: dict[str, Any] = {}
    cli.trainer.callbacks = [*cli.trainer.callbacks, _recorder(framework, rec)]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    _fitted(rec, cli.trainer)
    rec["test"] = {k: float(v) for k, v in cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)[0].items()}
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    rec["predictions"] = [_np(p) for p in predictions]
    return _finish(rec, cli.trainer, root, framework)


# ============================================================================ 2. autoencoder (LightningCLI)
def _autoencoder_lightning():
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset, random_split

    class ImageSampler(pl.Callback):
        def __init__(self, num_samples: int = 3, nrow: int = 8, padding: int = 2) -> None:
            super().__init__()
            self.num_samples, self.nrow, self.padding = num_samples, nrow, padding

        def _to_grid(self, images):
            return image_grid(images.reshape(-1, PIXELS, PIXELS).numpy(), nrow=self.nrow, padding=self.padding)

        def on_train_epoch_end(self, trainer, pl_module):
            images, _ = next(iter(DataLoader(trainer.datamodule.mnist_val, batch_size=self.num_samples)))
            images_flattened = images.view(images.size(0), -1)
            with torch.no_grad():
                pl_module.eval()
                images_generated = pl_module(images_flattened.to(pl_module.device))
                pl_module.train()
            out = trainer.default_root_dir
            if trainer.current_epoch == 0:
                save_image(self._to_grid(images), os.path.join(out, f"grid_ori_{trainer.current_epoch}.png"))
            grid = self._to_grid(images_generated.reshape(images.shape))
            save_image(grid, os.path.join(out, f"grid_generated_{trainer.current_epoch}.png"))

    class LitAutoEncoder(pl.LightningModule):
        def __init__(self, hidden_dim: int = 16, init_weights: str = "") -> None:
            super().__init__()
            self.save_hyperparameters()
            self.encoder = nn.Sequential(nn.Linear(PIXELS * PIXELS, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
            self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, PIXELS * PIXELS))
            if init_weights:
                torch.save(self.state_dict(), init_weights)

        def forward(self, x):
            z = self.encoder(x)
            return self.decoder(z)

        def training_step(self, batch, batch_idx):
            return self._common_step(batch, batch_idx, "train")

        def validation_step(self, batch, batch_idx):
            self._common_step(batch, batch_idx, "val")

        def test_step(self, batch, batch_idx):
            self._common_step(batch, batch_idx, "test")

        def predict_step(self, batch, batch_idx, dataloader_idx=None):
            x = self._prepare_batch(batch)
            return self(x)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def _prepare_batch(self, batch):
            x, _ = batch
            return x.view(x.size(0), -1)

        def _common_step(self, batch, batch_idx, stage: str):
            x = self._prepare_batch(batch)
            loss = F.mse_loss(x, self(x))
            self.log(f"{stage}_loss", loss, on_step=True)
            return loss

    class MyDataModule(pl.LightningDataModule):
        def __init__(self, batch_size: int = 32):
            super().__init__()
            dataset = TensorDataset(*map(torch.from_numpy, digits(120, seed=5)))
            self.mnist_test = TensorDataset(*map(torch.from_numpy, digits(24, seed=6)))
            self.mnist_train, self.mnist_val = random_split(
                dataset, [96, 24], generator=torch.Generator().manual_seed(42)
            )
            self.batch_size = batch_size

        def train_dataloader(self):
            return DataLoader(self.mnist_train, batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(self.mnist_val, batch_size=self.batch_size)

        def test_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

        def predict_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

    return LitAutoEncoder, MyDataModule, ImageSampler


def _autoencoder_jaxlight():
    import jax.numpy as jnp
    import optax
    import torch
    from flax import nnx
    from torch.utils.data import DataLoader, TensorDataset, random_split

    import jaxlight as jl
    from jaxlight.migrate import load_torch_weights

    class ImageSampler(jl.Callback):
        def __init__(self, num_samples: int = 3, nrow: int = 8, padding: int = 2) -> None:
            super().__init__()
            self.num_samples, self.nrow, self.padding = num_samples, nrow, padding

        def _to_grid(self, images):
            return image_grid(np.asarray(images).reshape(-1, PIXELS, PIXELS), nrow=self.nrow, padding=self.padding)

        def on_train_epoch_end(self, trainer, pl_module):
            images, _ = next(iter(DataLoader(trainer.datamodule.mnist_val, batch_size=self.num_samples)))
            images_flattened = jnp.asarray(images.numpy()).reshape(images.shape[0], -1)  # port: a jax array
            pl_module.eval()  # port: no torch.no_grad() or .to(device): nothing is differentiated here
            images_generated = pl_module(images_flattened)
            pl_module.train()
            out = trainer.default_root_dir
            if trainer.current_epoch == 0:
                save_image(self._to_grid(images), os.path.join(out, f"grid_ori_{trainer.current_epoch}.png"))
            grid = self._to_grid(images_generated.reshape(images.shape))
            save_image(grid, os.path.join(out, f"grid_generated_{trainer.current_epoch}.png"))

    class LitAutoEncoder(jl.LightningModule):
        def __init__(self, hidden_dim: int = 16, init_weights: str = "") -> None:
            super().__init__()
            self.save_hyperparameters()

        def configure_model(self):  # port: the layers, as NNX modules
            rngs, hidden_dim = nnx.Rngs(0), self.hparams.hidden_dim
            self.encoder = nnx.Sequential(
                nnx.Linear(PIXELS * PIXELS, hidden_dim, rngs=rngs), nnx.relu, nnx.Linear(hidden_dim, 3, rngs=rngs)
            )
            self.decoder = nnx.Sequential(
                nnx.Linear(3, hidden_dim, rngs=rngs), nnx.relu, nnx.Linear(hidden_dim, PIXELS * PIXELS, rngs=rngs)
            )

        def on_fit_start(self):
            if self.hparams.init_weights:  # port: start from the original's torch weights
                load_torch_weights(self, self.hparams.init_weights)

        def forward(self, x):
            z = self.encoder(x)
            return self.decoder(z)

        def training_step(self, batch, batch_idx):
            return self._common_step(batch, batch_idx, "train")

        def validation_step(self, batch, batch_idx):
            self._common_step(batch, batch_idx, "val")

        def test_step(self, batch, batch_idx):
            self._common_step(batch, batch_idx, "test")

        def predict_step(self, batch, batch_idx, dataloader_idx=None):
            x = self._prepare_batch(batch)
            return self(x)

        def configure_optimizers(self):
            return optax.adam(1e-2)  # port: optax's Adam

        def _prepare_batch(self, batch):
            x, _ = batch
            return x.reshape(x.shape[0], -1)

        def _common_step(self, batch, batch_idx, stage: str):
            x = self._prepare_batch(batch)
            loss = ((x - self(x)) ** 2).mean()  # port: F.mse_loss
            self.log(f"{stage}_loss", loss, on_step=True)
            return loss

    class MyDataModule(jl.LightningDataModule):
        def __init__(self, batch_size: int = 32):
            super().__init__()
            dataset = TensorDataset(*map(torch.from_numpy, digits(120, seed=5)))
            self.mnist_test = TensorDataset(*map(torch.from_numpy, digits(24, seed=6)))
            self.mnist_train, self.mnist_val = random_split(
                dataset, [96, 24], generator=torch.Generator().manual_seed(42)
            )
            self.batch_size = batch_size

        def train_dataloader(self):
            return DataLoader(self.mnist_train, batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(self.mnist_val, batch_size=self.batch_size)

        def test_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

        def predict_dataloader(self):
            return DataLoader(self.mnist_test, batch_size=self.batch_size)

    return LitAutoEncoder, MyDataModule, ImageSampler


def run_autoencoder(framework: str, root: str, init: str, max_epochs: int = 4) -> dict[str, Any]:
    """autoencoder.py's ``cli_main``: fit with the ImageSampler, test and predict from the best checkpoint."""
    if framework == "pl":
        _quiet_lightning()
        from pytorch_lightning.cli import LightningCLI

        Model, Data, ImageSampler = _autoencoder_lightning()
    else:
        from jaxlight.cli import LightningCLI

        Model, Data, ImageSampler = _autoencoder_jaxlight()
    rec: dict[str, Any] = {}
    defaults = {"callbacks": [ImageSampler(), _recorder(framework, rec)], "max_epochs": max_epochs}
    if framework == "pl":
        defaults.update(accelerator="cpu", devices=1)
    args = [
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.log_every_n_steps=1",
        f"--model.init_weights={init}",
    ]
    cli = LightningCLI(Model, Data, seed_everything_default=1234, run=False, trainer_defaults=defaults, args=args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    _fitted(rec, cli.trainer)
    rec["test"] = {k: float(v) for k, v in cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)[0].items()}
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    rec["predictions"] = [_np(p) for p in predictions]
    rec["images"] = {os.path.basename(p): read_image(p) for p in sorted(glob.glob(os.path.join(root, "grid_*.png")))}
    return _finish(rec, cli.trainer, root, framework)


# ============================================================================ 3. GAN (manual optimization)
IMG_SHAPE = (1, 4, 4)
LATENT = 8


def noise_projection() -> np.ndarray:
    """For a deterministic stand-in for ``torch.randn(n, latent)`` that both frameworks compute from the
    batch, ``sin(images @ P * 3)``: the differential test's runs then see the same noise."""
    return np.random.default_rng(7).normal(size=(int(np.prod(IMG_SHAPE)), LATENT)).astype(np.float32)


def _gan_lightning():
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Generator(nn.Module):
        def __init__(self, latent_dim: int = LATENT, img_shape: tuple = IMG_SHAPE):
            super().__init__()
            self.img_shape = img_shape

            def block(in_feat, out_feat, normalize=True):
                layers = [nn.Linear(in_feat, out_feat)]
                if normalize:
                    layers.append(nn.BatchNorm1d(out_feat, 0.8))
                layers.append(nn.LeakyReLU(0.2, inplace=True))
                return layers

            self.model = nn.Sequential(
                *block(latent_dim, 16, normalize=False),
                *block(16, 32),
                nn.Linear(32, int(np.prod(img_shape))),
                nn.Tanh(),
            )

        def forward(self, z):
            img = self.model(z)
            return img.view(img.size(0), *self.img_shape)

    class Discriminator(nn.Module):
        def __init__(self, img_shape: tuple = IMG_SHAPE):
            super().__init__()
            self.model = nn.Sequential(
                nn.Linear(int(np.prod(img_shape)), 32),
                nn.LeakyReLU(0.2, inplace=True),
                nn.Linear(32, 16),
                nn.LeakyReLU(0.2, inplace=True),
                nn.Linear(16, 1),
            )

        def forward(self, img):
            img_flat = img.view(img.size(0), -1)
            return self.model(img_flat)

    class GAN(pl.LightningModule):
        def __init__(self, img_shape: tuple = IMG_SHAPE, lr: float = 0.0002, b1: float = 0.5, b2: float = 0.999,
                     latent_dim: int = LATENT):  # fmt: skip
            super().__init__()
            self.save_hyperparameters()
            self.automatic_optimization = False
            self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
            self.discriminator = Discriminator(img_shape=img_shape)
            self.validation_z = torch.from_numpy(np.random.default_rng(3).normal(size=(8, latent_dim)).astype("f4"))
            self.samples = []

        def forward(self, z):
            return self.generator(z)

        @staticmethod
        def adversarial_loss(y_hat, y):
            return F.binary_cross_entropy_with_logits(y_hat, y)

        def sample_z(self, imgs):
            return torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)

        def training_step(self, batch):
            imgs, _ = batch
            opt_g, opt_d = self.optimizers()
            z = self.sample_z(imgs)

            # train generator
            valid = torch.ones(imgs.size(0), 1).type_as(imgs)
            self.toggle_optimizer(opt_g)
            g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            self.untoggle_optimizer(opt_g)

            # train discriminator: how well can it tell real from generated?
            self.toggle_optimizer(opt_d)
            real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
            fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
            fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
            d_loss = (real_loss + fake_loss) / 2
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            self.untoggle_optimizer(opt_d)

            self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

        def configure_optimizers(self):
            lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
            opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
            opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
            return opt_g, opt_d

        def on_train_epoch_end(self):
            with torch.no_grad():
                sample_imgs = self(self.validation_z.type_as(self.generator.model[0].weight))
            self.samples.append(image_grid(sample_imgs[:, 0].numpy()))

    return GAN


def _gan_jaxlight():
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxlight as jl

    class Generator(nnx.Module):
        def __init__(self, latent_dim: int = LATENT, img_shape: tuple = IMG_SHAPE, rngs: nnx.Rngs | None = None):
            self.img_shape = img_shape
            rngs = rngs or nnx.Rngs(0)
            leaky = lambda x: nnx.leaky_relu(x, 0.2)  # port: parameterless layers are functions

            def block(in_feat, out_feat, normalize=True):
                layers = [nnx.Linear(in_feat, out_feat, rngs=rngs)]
                if normalize:  # port: torch's momentum and eps (BatchNorm1d(out_feat, 0.8))
                    layers.append(nnx.BatchNorm(out_feat, epsilon=0.8, momentum=0.9, rngs=rngs))
                layers.append(leaky)
                return layers

            self.model = nnx.Sequential(
                *block(latent_dim, 16, normalize=False),
                *block(16, 32),
                nnx.Linear(32, int(np.prod(img_shape)), rngs=rngs),
                jnp.tanh,
            )

        def __call__(self, z):
            img = self.model(z)
            return img.reshape(img.shape[0], *self.img_shape)

    class Discriminator(nnx.Module):
        def __init__(self, img_shape: tuple = IMG_SHAPE, rngs: nnx.Rngs | None = None):
            rngs = rngs or nnx.Rngs(1)
            leaky = lambda x: nnx.leaky_relu(x, 0.2)
            self.model = nnx.Sequential(
                nnx.Linear(int(np.prod(img_shape)), 32, rngs=rngs),
                leaky,
                nnx.Linear(32, 16, rngs=rngs),
                leaky,
                nnx.Linear(16, 1, rngs=rngs),
            )

        def __call__(self, img):
            img_flat = img.reshape(img.shape[0], -1)
            return self.model(img_flat)

    class GAN(jl.LightningModule):
        def __init__(self, img_shape: tuple = IMG_SHAPE, lr: float = 0.0002, b1: float = 0.5, b2: float = 0.999,
                     latent_dim: int = LATENT, init_weights: str = ""):  # fmt: skip
            super().__init__()
            self.save_hyperparameters()
            self.automatic_optimization = False
            self.validation_z = np.random.default_rng(3).normal(size=(8, latent_dim)).astype("f4")
            self.samples = []

        def configure_model(self):  # port: the layers, as NNX modules, and the noise stream
            hp = self.hparams
            self.generator = Generator(latent_dim=hp.latent_dim, img_shape=tuple(hp.img_shape))
            self.discriminator = Discriminator(img_shape=tuple(hp.img_shape))
            self.rngs = nnx.Rngs(noise=0)

        def on_fit_start(self):
            if self.hparams.init_weights:  # port: start from the original's torch weights
                from jaxlight.migrate import load_torch_weights

                load_torch_weights(self, self.hparams.init_weights)

        def forward(self, z):
            return self.generator(z)

        @staticmethod
        def adversarial_loss(y_hat, y):
            return optax.sigmoid_binary_cross_entropy(y_hat, y).mean()  # port: optax's loss

        def sample_z(self, imgs):
            return jax.random.normal(self.rngs.noise(), (imgs.shape[0], self.hparams.latent_dim))  # port

        def training_step(self, batch):
            imgs, _ = batch
            opt_g, opt_d = self.optimizers()
            z = self.sample_z(imgs)

            # train generator (port: manual_backward differentiates a function; opt.step applies the grads)
            valid = jnp.ones((imgs.shape[0], 1), imgs.dtype)
            g_loss, grads = self.manual_backward(
                lambda: self.adversarial_loss(self.discriminator(self(z)), valid), optimizer=opt_g
            )
            opt_g.step(grads)

            # train discriminator: how well can it tell real from generated?
            def d_loss_fn():
                real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
                fake = jnp.zeros((imgs.shape[0], 1), imgs.dtype)
                fake_loss = self.adversarial_loss(self.discriminator(jax.lax.stop_gradient(self(z))), fake)
                return (real_loss + fake_loss) / 2

            d_loss, grads = self.manual_backward(d_loss_fn, optimizer=opt_d)
            opt_d.step(grads)

            self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

        def configure_optimizers(self):
            lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
            opt_g = optax.adam(lr, b1=b1, b2=b2)  # port: "params" names what each optimizer updates
            opt_d = optax.adam(lr, b1=b1, b2=b2)
            return [{"optimizer": opt_g, "params": self.generator}, {"optimizer": opt_d, "params": self.discriminator}]

        def on_train_epoch_end(self):
            sample_imgs = self(jnp.asarray(self.validation_z))  # training mode, as the original's
            self.samples.append(image_grid(np.asarray(sample_imgs)[:, 0]))

    return GAN


def run_gan(framework: str, root: str, init: str, max_epochs: int = 3, shared: bool = True) -> dict[str, Any]:
    """generative_adversarial_net.py's ``main``: fit. ``shared``: both frameworks draw the noise from
    :func:`shared_noise` (torch's ``randn`` and JAX's keys differ), so that the losses can be compared."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x, y = digits(64, seed=8)
    imgs = 2 * x[:, :, ::2, ::2] - 1  # 1x4x4 images in [-1, 1], as the generator's tanh
    if framework == "pl":
        _quiet_lightning()
        import pytorch_lightning as pl

        Base = _gan_lightning()

        class GAN(Base):
            def sample_z(self, imgs):
                if not shared:
                    return super().sample_z(imgs)
                return torch.sin(imgs.reshape(imgs.shape[0], -1) @ torch.from_numpy(noise_projection()) * 3.0)

        pl.seed_everything(0)
        model = GAN()
        torch.save(model.state_dict(), init)
        trainer = pl.Trainer(max_epochs=max_epochs, default_root_dir=root, accelerator="cpu", devices=1,
                             enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)  # fmt: skip
    else:
        import jax.numpy as jnp

        import jaxlight as jl

        Base = _gan_jaxlight()

        class GAN(Base):
            def sample_z(self, imgs):
                if not shared:
                    return super().sample_z(imgs)
                return jnp.sin(imgs.reshape(imgs.shape[0], -1) @ jnp.asarray(noise_projection()) * 3.0)

        model = GAN(init_weights=init)
        trainer = jl.Trainer(max_epochs=max_epochs, default_root_dir=root, enable_progress_bar=False,
                             enable_model_summary=False, log_every_n_steps=1)  # fmt: skip
    loader = DataLoader(TensorDataset(torch.from_numpy(imgs), torch.from_numpy(y)), batch_size=16)
    rec: dict[str, Any] = {}
    trainer.callbacks = [*trainer.callbacks, _recorder(framework, rec, keys=("g_loss", "d_loss"))]
    trainer.fit(model, loader)
    _fitted(rec, trainer)
    rec["samples"] = [np.asarray(s) for s in model.samples]
    return _finish(rec, trainer, root, framework)


# ============================================================================ 4. transformer LM (clipping)
VOCAB, SEQ = 24, 8


def token_blocks(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A WikiText2 stand-in: (input, target) blocks of a token stream with some structure."""
    rng = np.random.default_rng(seed)
    stream = np.cumsum(rng.integers(1, 4, rows * SEQ + 1)) % VOCAB
    blocks = np.lib.stride_tricks.sliding_window_view(stream, SEQ + 1)[::SEQ][:rows]
    return blocks[:, :-1].astype(np.int64), blocks[:, 1:].astype(np.int64)


def _transformer_lightning():
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.demos import Transformer

    class LanguageModel(pl.LightningModule):
        def __init__(self, vocab_size: int = VOCAB):
            super().__init__()
            self.model = Transformer(vocab_size=vocab_size, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)

        def training_step(self, batch, batch_idx):
            input, target = batch
            output = self.model(input, target)
            loss = torch.nn.functional.nll_loss(output, target.view(-1))
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            input, target = batch
            output = self.model(input, target)
            loss = torch.nn.functional.nll_loss(output, target.view(-1))
            self.log("val_loss", loss, prog_bar=True)
            return loss

        def test_step(self, batch, batch_idx):
            input, target = batch
            output = self.model(input, target)
            loss = torch.nn.functional.nll_loss(output, target.view(-1))
            self.log("test_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return LanguageModel


def _transformer_jaxlight():
    import math

    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxlight as jl

    # port: the demo Transformer (torch's nn.Transformer, post-norm, ReLU) as an NNX twin with torch's names
    def attention(ninp, nhead, rngs):
        return nnx.MultiHeadAttention(nhead, ninp, decode=False, rngs=rngs)

    class EncoderLayer(nnx.Module):
        def __init__(self, ninp, nhead, nhid, rngs):
            self.self_attn = attention(ninp, nhead, rngs)
            self.linear1, self.linear2 = nnx.Linear(ninp, nhid, rngs=rngs), nnx.Linear(nhid, ninp, rngs=rngs)
            self.norm1 = nnx.LayerNorm(ninp, epsilon=1e-5, rngs=rngs)
            self.norm2 = nnx.LayerNorm(ninp, epsilon=1e-5, rngs=rngs)

        def __call__(self, x):
            x = self.norm1(x + self.self_attn(x))
            return self.norm2(x + self.linear2(nnx.relu(self.linear1(x))))

    class DecoderLayer(nnx.Module):
        def __init__(self, ninp, nhead, nhid, rngs):
            self.self_attn = attention(ninp, nhead, rngs)
            self.multihead_attn = attention(ninp, nhead, rngs)
            self.linear1, self.linear2 = nnx.Linear(ninp, nhid, rngs=rngs), nnx.Linear(nhid, ninp, rngs=rngs)
            self.norm1 = nnx.LayerNorm(ninp, epsilon=1e-5, rngs=rngs)
            self.norm2 = nnx.LayerNorm(ninp, epsilon=1e-5, rngs=rngs)
            self.norm3 = nnx.LayerNorm(ninp, epsilon=1e-5, rngs=rngs)

        def __call__(self, x, memory, mask):
            x = self.norm1(x + self.self_attn(x, mask=mask))
            x = self.norm2(x + self.multihead_attn(x, memory))
            return self.norm3(x + self.linear2(nnx.relu(self.linear1(x))))

    class Stack(nnx.Module):
        def __init__(self, layers, ninp, rngs):
            self.layers = nnx.List(layers)
            self.norm = nnx.LayerNorm(ninp, epsilon=1e-5, rngs=rngs)

    class Seq2Seq(nnx.Module):
        def __init__(self, ninp, nhead, nhid, nlayers, rngs):
            self.encoder = Stack([EncoderLayer(ninp, nhead, nhid, rngs) for _ in range(nlayers)], ninp, rngs)
            self.decoder = Stack([DecoderLayer(ninp, nhead, nhid, rngs) for _ in range(nlayers)], ninp, rngs)

        def __call__(self, src, tgt, tgt_mask):
            for layer in self.encoder.layers:
                src = layer(src)
            memory = self.encoder.norm(src)
            for layer in self.decoder.layers:
                tgt = layer(tgt, memory, tgt_mask)
            return self.decoder.norm(tgt)

    def positional_encoding(dim, max_len=5000):
        position = np.arange(max_len, dtype=np.float32)[:, None]
        div_term = np.exp(np.arange(0, dim, 2, dtype=np.float32) * (-math.log(10000.0) / dim))
        pe = np.zeros((max_len, dim), np.float32)
        pe[:, 0::2], pe[:, 1::2] = np.sin(position * div_term), np.cos(position * div_term)
        return pe[None]

    class Transformer(nnx.Module):
        def __init__(self, vocab_size, ninp=200, nhead=2, nhid=200, nlayers=2, rngs=None):
            rngs = rngs or nnx.Rngs(0)
            self.embedding = nnx.Embed(vocab_size, ninp, rngs=rngs)
            self.transformer = Seq2Seq(ninp, nhead, nhid, nlayers, rngs)
            self.decoder = nnx.Linear(ninp, vocab_size, rngs=rngs)
            self.ninp, self.vocab_size = ninp, vocab_size

        def __call__(self, inputs, target):
            t = inputs.shape[1]
            pe = positional_encoding(self.ninp)[:, t]  # the demo adds position t's encoding everywhere
            src = self.embedding(inputs) * math.sqrt(self.ninp) + pe
            tgt = self.embedding(target) * math.sqrt(self.ninp) + pe
            output = self.transformer(src, tgt, nnx.make_causal_mask(target))
            return nnx.log_softmax(self.decoder(output), axis=-1).reshape(-1, self.vocab_size)

    def nll_loss(logp, target):  # port: torch's nll_loss on log-probabilities
        return -jnp.take_along_axis(logp, target[:, None], axis=1).mean()

    class LanguageModel(jl.LightningModule):
        def __init__(self, vocab_size: int = VOCAB, init_weights: str = ""):
            super().__init__()
            self.vocab_size, self.init_weights = vocab_size, init_weights

        def configure_model(self):
            self.model = Transformer(vocab_size=self.vocab_size, ninp=16, nhead=2, nhid=32, nlayers=1)

        def on_fit_start(self):
            if self.init_weights:  # port: start from the original's torch weights
                from jaxlight.migrate import load_torch_weights

                load_torch_weights(self, self.init_weights)

        def training_step(self, batch, batch_idx):
            input, target = batch
            output = self.model(input, target)
            loss = nll_loss(output, target.reshape(-1))
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            input, target = batch
            output = self.model(input, target)
            loss = nll_loss(output, target.reshape(-1))
            self.log("val_loss", loss, prog_bar=True)
            return loss

        def test_step(self, batch, batch_idx):
            input, target = batch
            output = self.model(input, target)
            loss = nll_loss(output, target.reshape(-1))
            self.log("test_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return optax.sgd(0.1)  # port: optax's SGD

    return LanguageModel


def run_transformer(framework: str, root: str, init: str, max_epochs: int = 3) -> dict[str, Any]:
    """transformer.py's ``main``: seed, split, fit with ``gradient_clip_val=0.25``, test."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset, random_split

    x, y = token_blocks(96, seed=9)
    dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    n = len(dataset)
    train_dataset, val_dataset, test_dataset = random_split(
        dataset, [n - 32, 16, 16], generator=torch.Generator().manual_seed(42)
    )
    shuffle = torch.Generator().manual_seed(0)
    train_dataloader = DataLoader(train_dataset, batch_size=16, shuffle=True, generator=shuffle)
    val_dataloader = DataLoader(val_dataset, batch_size=16)
    test_dataloader = DataLoader(test_dataset, batch_size=16)
    common = dict(gradient_clip_val=0.25, max_epochs=max_epochs, default_root_dir=root, log_every_n_steps=1,
                  enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    if framework == "pl":
        _quiet_lightning()
        import pytorch_lightning as pl

        pl.seed_everything(42)
        model = _transformer_lightning()()
        torch.save(model.state_dict(), init)
        trainer = pl.Trainer(accelerator="cpu", devices=1, **common)
    else:
        import jaxlight as jl

        jl.seed_everything(42)
        model = _transformer_jaxlight()(init_weights=init)
        trainer = jl.Trainer(**common)
    rec: dict[str, Any] = {}
    trainer.callbacks = [*trainer.callbacks, _recorder(framework, rec)]
    trainer.fit(model, train_dataloader, val_dataloader)
    _fitted(rec, trainer)
    rec["test"] = {k: float(v) for k, v in trainer.test(model, test_dataloader, verbose=False)[0].items()}
    return _finish(rec, trainer, root, framework)


# ============================================================================ 5. fine-tuning (BaseFinetuning)
IMG, CH = 12, 3


def cats_and_dogs(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noise images (NCHW); "dogs" (label 1) have a brighter centre."""
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=0.6, size=(rows, CH, IMG, IMG)).astype(np.float32)
    y = rng.integers(0, 2, rows)
    x[y == 1, :, 3:9, 3:9] += 0.8
    return x, y.astype(np.int64)


def _finetune_lightning():
    """The Lightning original (as computer_vision_fine_tuning.py writes it, shrunk)."""
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from pytorch_lightning.callbacks.finetuning import BaseFinetuning
    from pytorch_lightning.cli import LightningCLI
    from torch import nn, optim
    from torch.optim.lr_scheduler import MultiStepLR
    from torch.utils.data import DataLoader, TensorDataset

    class MilestonesFinetuning(BaseFinetuning):
        def __init__(self, milestones: tuple = (1, 2), train_bn: bool = False):
            super().__init__()
            self.milestones = milestones
            self.train_bn = train_bn

        def freeze_before_training(self, pl_module: pl.LightningModule):
            self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

        def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: optim.Optimizer):
            if epoch == self.milestones[0]:
                # unfreeze the last block
                self.unfreeze_and_add_param_group(
                    modules=pl_module.feature_extractor[-3:], optimizer=optimizer, train_bn=self.train_bn
                )
            elif epoch == self.milestones[1]:
                # unfreeze the remaining layers
                self.unfreeze_and_add_param_group(
                    modules=pl_module.feature_extractor[:-3], optimizer=optimizer, train_bn=self.train_bn
                )

    class CatDogImageDataModule(pl.LightningDataModule):
        def __init__(self, batch_size: int = 16, train_rows: int = 96, val_rows: int = 32):
            super().__init__()
            self._batch_size = batch_size
            self.train_set = TensorDataset(*map(torch.from_numpy, cats_and_dogs(train_rows, seed=1)))
            self.val_set = TensorDataset(*map(torch.from_numpy, cats_and_dogs(val_rows, seed=2)))

        def train_dataloader(self):
            shuffle = torch.Generator().manual_seed(0)
            return DataLoader(self.train_set, batch_size=self._batch_size, shuffle=True, generator=shuffle)

        def val_dataloader(self):
            return DataLoader(self.val_set, batch_size=self._batch_size)

    class TransferLearningModel(pl.LightningModule):
        def __init__(
            self,
            train_bn: bool = False,
            milestones: tuple = (1, 2),
            batch_size: int = 16,
            lr: float = 1e-2,
            lr_scheduler_gamma: float = 1e-1,
            init_weights: str | None = None,
        ) -> None:
            super().__init__()
            self.train_bn = train_bn
            self.milestones = milestones
            self.batch_size = batch_size
            self.lr = lr
            self.lr_scheduler_gamma = lr_scheduler_gamma
            self.__build_model()
            self.save_hyperparameters()
            if init_weights is not None:
                torch.save(self.state_dict(), init_weights)  # the initial weights, for the port

        def __build_model(self):
            self.feature_extractor = nn.Sequential(  # a small stand-in for the pretrained resnet50
                nn.Conv2d(CH, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(8, 16, 3, padding=1),
                nn.BatchNorm2d(16),
                nn.ReLU(),
            )
            self.fc = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 1))
            self.loss_func = F.binary_cross_entropy_with_logits

        def forward(self, x):
            x = self.feature_extractor(x).mean((2, 3))
            return self.fc(x)

        def loss(self, logits, labels):
            return self.loss_func(input=logits, target=labels)

        def training_step(self, batch, batch_idx):
            x, y = batch
            y_logits = self.forward(x)
            y_true = y.view((-1, 1)).type_as(x)
            train_loss = self.loss(y_logits, y_true)
            self.log("train_acc", ((y_logits > 0).float() == y_true).float().mean(), prog_bar=True)
            return train_loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            y_logits = self.forward(x)
            y_true = y.view((-1, 1)).type_as(x)
            self.log("val_loss", self.loss(y_logits, y_true), prog_bar=True)
            self.log("val_acc", ((y_logits > 0).float() == y_true).float().mean(), prog_bar=True)

        def configure_optimizers(self):
            parameters = list(self.parameters())
            trainable_parameters = list(filter(lambda p: p.requires_grad, parameters))
            optimizer = optim.Adam(trainable_parameters, lr=self.lr)
            scheduler = MultiStepLR(optimizer, milestones=self.milestones, gamma=self.lr_scheduler_gamma)
            return [optimizer], [scheduler]

    class MyLightningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(MilestonesFinetuning, "finetuning")
            parser.link_arguments("data.batch_size", "model.batch_size")
            parser.link_arguments("finetuning.milestones", "model.milestones")
            parser.link_arguments("finetuning.train_bn", "model.train_bn")
            parser.set_defaults(
                {"trainer.max_epochs": 4, "trainer.enable_model_summary": False, "trainer.num_sanity_val_steps": 0}
            )

    return TransferLearningModel, CatDogImageDataModule, MyLightningCLI, pl


def _finetune_jaxlight():
    """The jaxlight port."""
    import jax.numpy as jnp
    import optax
    import torch
    from flax import nnx
    from torch.utils.data import DataLoader, TensorDataset

    import jaxlight as jl
    from jaxlight.callbacks import BaseFinetuning
    from jaxlight.cli import LightningCLI
    from jaxlight.migrate import load_torch_weights

    class MilestonesFinetuning(BaseFinetuning):
        def __init__(self, milestones: tuple = (1, 2), train_bn: bool = False):
            super().__init__()
            self.milestones = milestones
            self.train_bn = train_bn

        def freeze_before_training(self, pl_module: jl.LightningModule):
            self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

        def finetune_function(self, pl_module: jl.LightningModule, epoch: int, optimizer):
            if epoch == self.milestones[0]:
                # unfreeze the last block
                self.unfreeze_and_add_param_group(
                    modules=pl_module.feature_extractor.layers[-3:],  # port: .layers[-3:] for torch's [-3:]
                    optimizer=optimizer,
                    train_bn=self.train_bn,
                )
            elif epoch == self.milestones[1]:
                # unfreeze the remaining layers
                self.unfreeze_and_add_param_group(
                    modules=pl_module.feature_extractor.layers[:-3], optimizer=optimizer, train_bn=self.train_bn
                )

    class CatDogImageDataModule(jl.LightningDataModule):
        def __init__(self, batch_size: int = 16, train_rows: int = 96, val_rows: int = 32):
            super().__init__()
            self._batch_size = batch_size
            x, y = cats_and_dogs(train_rows, seed=1)
            self.train_set = TensorDataset(torch.from_numpy(x.transpose(0, 2, 3, 1).copy()), torch.from_numpy(y))
            x, y = cats_and_dogs(val_rows, seed=2)  # port: channels-last images (above too)
            self.val_set = TensorDataset(torch.from_numpy(x.transpose(0, 2, 3, 1).copy()), torch.from_numpy(y))

        def train_dataloader(self):
            shuffle = torch.Generator().manual_seed(0)
            return DataLoader(self.train_set, batch_size=self._batch_size, shuffle=True, generator=shuffle)

        def val_dataloader(self):
            return DataLoader(self.val_set, batch_size=self._batch_size)

    def max_pool(x):  # port: torch's parameterless layers become functions in nnx.Sequential
        return nnx.max_pool(x, (2, 2), strides=(2, 2))

    class TransferLearningModel(jl.LightningModule):
        def __init__(
            self,
            train_bn: bool = False,
            milestones: tuple = (1, 2),
            batch_size: int = 16,
            lr: float = 1e-2,
            lr_scheduler_gamma: float = 1e-1,
            init_weights: str | None = None,
        ) -> None:
            super().__init__()
            self.train_bn = train_bn
            self.milestones = milestones
            self.batch_size = batch_size
            self.lr = lr
            self.lr_scheduler_gamma = lr_scheduler_gamma
            self.init_weights = init_weights
            self.save_hyperparameters()

        def configure_model(self):  # port: the layers are built here, as NNX modules
            rngs = nnx.Rngs(0)
            self.feature_extractor = nnx.Sequential(
                nnx.Conv(CH, 8, (3, 3), padding=1, rngs=rngs),
                nnx.BatchNorm(8, momentum=0.9, epsilon=1e-5, rngs=rngs),  # port: torch's momentum and eps
                nnx.relu,
                max_pool,
                nnx.Conv(8, 16, (3, 3), padding=1, rngs=rngs),
                nnx.BatchNorm(16, momentum=0.9, epsilon=1e-5, rngs=rngs),
                nnx.relu,
            )
            self.fc = nnx.Sequential(
                nnx.Linear(16, 8, rngs=rngs), nnx.relu, nnx.Linear(8, 4, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)
            )

        def on_fit_start(self):
            if self.init_weights is not None:  # port: start from the original's torch weights
                load_torch_weights(self, self.init_weights)

        def forward(self, x):
            x = self.feature_extractor(x).mean((1, 2))
            return self.fc(x)

        def loss(self, logits, labels):
            return optax.sigmoid_binary_cross_entropy(logits, labels).mean()  # port: optax's loss

        def training_step(self, batch, batch_idx):
            x, y = batch
            y_logits = self.forward(x)
            y_true = y.reshape((-1, 1)).astype(x.dtype)
            train_loss = self.loss(y_logits, y_true)
            self.log("train_acc", ((y_logits > 0) == y_true).mean(), prog_bar=True)
            return train_loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            y_logits = self.forward(x)
            y_true = y.reshape((-1, 1)).astype(x.dtype)
            self.log("val_loss", self.loss(y_logits, y_true), prog_bar=True)
            self.log("val_acc", ((y_logits > 0) == y_true).mean(), prog_bar=True)

        def configure_optimizers(self):
            # port: frozen parameters are left out by the trainer; MultiStepLR is a piecewise-constant
            # schedule stepped per epoch, which sets the injected learning rate
            optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=self.lr)
            milestones = {int(m): self.lr_scheduler_gamma for m in self.milestones}
            scheduler = optax.piecewise_constant_schedule(self.lr, milestones)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    class MyLightningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(MilestonesFinetuning, "finetuning")
            parser.link_arguments("data.batch_size", "model.batch_size")
            parser.link_arguments("finetuning.milestones", "model.milestones")
            parser.link_arguments("finetuning.train_bn", "model.train_bn")
            parser.set_defaults(
                {"trainer.max_epochs": 4, "trainer.enable_model_summary": False, "trainer.num_sanity_val_steps": 0}
            )

    del jnp
    return TransferLearningModel, CatDogImageDataModule, MyLightningCLI, jl


def _finetune_args(root: str, init: str, extra: list[str]) -> list[str]:
    return [
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=2",
        f"--model.init_weights={init}",
        "--seed_everything=0",
        *extra,
    ]


def run_finetune(framework: str, root: str, init: str, extra: list[str] = ()) -> dict[str, Any]:
    """The fine-tuning program through its LightningCLI (``fit``); what the run leaves behind."""
    if framework == "pl":
        _quiet_lightning()
        import pytorch_lightning as pl

        Model, Data, CLI, fw = _finetune_lightning()
        Callback = pl.Callback
        kw = {"trainer_defaults": {"accelerator": "cpu", "devices": 1}}
    else:
        import jaxlight as jl

        Model, Data, CLI, fw = _finetune_jaxlight()
        Callback = jl.Callback
        kw = {}
    rec: dict[str, Any] = {"losses": [], "val": [], "stats": [], "lr": []}

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rec["losses"].append(_f(outputs["loss"]))

        def on_validation_end(self, trainer, pl_module):
            m = trainer.callback_metrics
            rec["val"].append({k: _f(m[k]) for k in ("val_loss", "val_acc")})

        def on_train_epoch_end(self, trainer, pl_module):
            bn = pl_module.feature_extractor[1] if framework == "pl" else pl_module.feature_extractor.layers[1]
            mean = bn.running_mean if framework == "pl" else bn.mean[...]
            var = bn.running_var if framework == "pl" else bn.var[...]
            rec["stats"].append((np.asarray(_np(mean)), np.asarray(_np(var))))

    cli = CLI(Model, Data, args=_finetune_args(root, init, list(extra)), run=False, **kw)
    cli.trainer.callbacks = [*cli.trainer.callbacks, Record()]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    t = cli.trainer
    rec.update(
        metric_names=sorted(t.callback_metrics),
        checkpoints=_ckpt_names(root),
        current_epoch=t.current_epoch,
        global_step=t.global_step,
        compile_counts=dict(t.compile_counts) if framework == "jl" else None,
    )
    del fw
    return rec


def _np(x: Any) -> np.ndarray:
    return x.detach().numpy().copy() if hasattr(x, "detach") else np.array(x)
