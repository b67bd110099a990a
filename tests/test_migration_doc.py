"""docs/migration.md runs as written and says what the code does, and the three Lightning programs in
tests/migration_programs/ port as it says.

The page's ``python`` blocks run in order, in two namespaces: blocks whose first line is
``# PyTorch Lightning`` with pytorch-lightning and torch, the others with jaxlight. The tests then check
the claims the blocks print (torch-identical schedules and weights, masked evaluation over every sample,
a Lightning checkpoint loaded into the port, ...) against values computed independently here, and that
the page names every Lightning Trainer argument, callback, hook and module attribute jaxlight lacks.

The program tests run each Lightning original and its jaxlight port from the same initial torch weights
and compare what a user sees: the epoch early stopping stopped at, checkpoint names, losses per step,
where a resumed run continues.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import numpy as np
import pytest

pl = pytest.importorskip("pytorch_lightning")
torch = pytest.importorskip("torch")

import jaxlight as jl  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "migration.md"
LIGHTNING = "# PyTorch Lightning"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def doc_run(tmp_path_factory):
    """Every python block of the page, run once (cwd: a fresh directory); the two namespaces and stdout."""
    import contextlib
    import io
    import warnings

    blocks = python_blocks()
    assert len(blocks) >= 15 and any(b.startswith(LIGHTNING) for b in blocks)
    pl_ns: dict = {"__name__": "docs_migration_lightning"}
    jl_ns: dict = {"__name__": "docs_migration"}
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("migration_doc"))
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, code in enumerate(blocks):
                ns = pl_ns if code.startswith(LIGHTNING) else jl_ns
                exec(compile(code, f"migration.md[block {i}]", "exec"), ns)
        yield pl_ns, jl_ns, out.getvalue()
    finally:
        os.chdir(cwd)


def test_side_by_side_programs_both_train(doc_run):
    pl_ns, jl_ns, out = doc_run
    pl_acc, jl_acc = pl_ns["val_acc"], jl_ns["val_acc"]
    assert pl_acc > 0.8 and jl_acc > 0.8, (pl_acc, jl_acc)
    # the same architecture: as many parameters as the torch module
    n_torch = sum(p.numel() for p in pl_ns["LitClassifier"]().parameters())
    assert f"\n{n_torch}\n" in out
    assert "(4, 4)" in out and "['net/layers/0/bias', 'net/layers/0/kernel']" in out


def test_f1_from_outputs_on_the_host(doc_run):
    _, ns, _ = doc_run
    model, val = ns["f1_trainer"].lightning_module, ns["val"]
    pred = np.concatenate([np.asarray(model(x.numpy()).argmax(-1)) for x, _ in val])
    true = np.concatenate([y.numpy() for _, y in val])
    f1 = [2 * ((pred == c) & (true == c)).sum() / max((pred == c).sum() + (true == c).sum(), 1) for c in range(4)]
    assert float(ns["f1_trainer"].callback_metrics["val_f1"]) == pytest.approx(np.mean(f1), abs=1e-6)


def test_custom_callback_both_ways(doc_run):
    pl_ns, jl_ns, _ = doc_run
    for ns in (pl_ns, jl_ns):
        counter = ns["counter"]
        assert counter.samples == 2 * 256 and len(counter.losses) == 2 * 8
        assert counter.state_dict() == {"samples": 512}
    # the jaxlight losses are the batches' losses (finite, falling over two epochs)
    losses = jl_ns["counter"].losses
    assert np.isfinite(losses).all() and np.mean(losses[8:]) < np.mean(losses[:8])


def test_masked_validation_counts_every_sample_once(doc_run):
    _, ns, _ = doc_run
    t = ns["dm_trainer"]
    assert t.num_val_batches == 4  # Lightning: [4] (documented difference)
    dm, model = t.datamodule, t.lightning_module
    x, y = dm.val_set.tensors
    exact = float((np.asarray(model(x.numpy()).argmax(-1)) == y.numpy()).mean())  # over the 100 rows
    assert float(t.callback_metrics["val_acc"]) == pytest.approx(exact, abs=1e-6)


def test_checkpoints_and_resume(doc_run):
    _, ns, out = doc_run
    ckpt = ns["ckpt"]
    names = sorted(p.name for p in Path(ckpt.dirpath).iterdir())
    assert "last.ckpt" in names and len(names) == 3
    kept = [n for n in names if n != "last.ckpt"]
    assert all(re.fullmatch(r"epoch=\d-val_loss=\d\.\d\d\.ckpt", n) for n in kept)
    assert os.path.basename(ckpt.best_model_path) in kept
    assert ns["resumed"].current_epoch == 5 and ns["resumed"].global_step == 5 * 8
    assert "restored fit state" in out


def test_lightning_checkpoint_loads_into_the_port(doc_run):
    pl_ns, jl_ns, _ = doc_run
    lightning_acc = float(pl_ns["trainer"].callback_metrics["val_acc"])  # the weights of the last checkpoint
    assert jl_ns["ported_acc"] == pytest.approx(lightning_acc, abs=1e-6)


def test_fsdp_bf16_example(doc_run):
    _, ns, _ = doc_run
    t = ns["fsdp_trainer"]
    assert t.mesh.shape["fsdp"] == 8 and t.precision == "bf16-mixed"
    assert all(v.dtype == np.float32 for v in t.train_state.params.values())  # fp32 masters
    assert np.isfinite(float(t.callback_metrics["train_loss"]))


def test_schedules_equal_torch(doc_run):
    _, ns, out = doc_run
    gaps = [float(g) for g in re.findall(r"max difference (\S+)", out)]
    assert len(gaps) == len(ns["same_as_torch"]) and max(gaps) < 1e-7


def test_optimizers_equal_torch(doc_run):
    _, ns, out = doc_run
    gaps = [float(g) for g in re.findall(r"weights differ by (\S+)", out)]
    assert len(gaps) == len(ns["same_update"]) and max(gaps) < 1e-6


def test_parameter_groups_named_as_lightning(doc_run):
    _, ns, _ = doc_run
    assert sorted(ns["monitor"].lrs) == ["lr-SGD/pg1", "lr-SGD/pg2"]


def test_porting_examples(doc_run):
    """What tests/test_migrate.py::test_porting_doc_examples_run checked for docs/porting_torch.md (moved here)."""
    _, ns, out = doc_run
    assert float(re.search(r"max difference: (\S+)", out).group(1)) < 1e-5
    assert "set momentum=0.9" in out and "True False" in out and "bf16-mixed" in out
    torch_model = ns["torch_model"]
    expected = np.mean(
        [
            torch.nn.functional.cross_entropy(
                torch_model(torch.from_numpy(x.transpose(0, 3, 1, 2))), torch.from_numpy(y)
            ).item()
            for x, y in ns["data"]
        ]
    )
    assert ns["baseline"] == pytest.approx(float(expected), abs=1e-5)
    assert np.asarray(ns["predictions"][0]).shape == (16, 10)
    # torch's initialisation recipe: the bounds are torch's
    layer = ns["layer"]
    assert (
        np.abs(np.asarray(layer.kernel[...])).max() <= 256**-0.5
        and np.abs(np.asarray(layer.bias[...])).max() <= 256**-0.5
    )
    # loading in on_fit_start trains from the same weights as loading after a validate: the same result
    import jax
    from flax import nnx

    trained = [jax.tree.leaves(nnx.state(m.net, nnx.Param)) for m in (ns["lit"], ns["from_torch"])]
    for a, b in zip(*trained):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------- the differences table
def _documented(name: str, text: str) -> bool:
    return f"`{name}`" in text or re.search(rf"`[^`]*\b{re.escape(name)}\b[^`]*`", text) is not None


def test_every_missing_lightning_api_is_documented():
    """Each Lightning Trainer argument, callback, callback hook, module/datamodule attribute and logger that
    jaxlight lacks is named on the page (with its replacement in the tables)."""
    import torch.nn

    text = DOC.read_text()
    missing: dict[str, list[str]] = {}

    def params(f):
        return list(inspect.signature(f).parameters)[1:]

    jl_args = set(params(jl.Trainer.__init__))
    missing["Trainer argument"] = [p for p in params(pl.Trainer.__init__) if p not in jl_args]
    torch_attrs = set(dir(torch.nn.Module))
    constants = {"CHECKPOINT_HYPER_PARAMS_KEY", "CHECKPOINT_HYPER_PARAMS_NAME", "CHECKPOINT_HYPER_PARAMS_TYPE"}
    # the loader methods are the user's to define (jaxlight reads them when present), fabric/hparams helpers
    # are internals
    not_features = constants | {"fabric", "remove_ignored_hparams", "train_dataloader", "val_dataloader"}
    not_features |= {"test_dataloader", "predict_dataloader", "name"}
    missing["LightningModule attribute"] = sorted(
        n
        for n in dir(pl.LightningModule)
        if not n.startswith("_") and not hasattr(jl.LightningModule, n) and n not in torch_attrs | not_features
    )
    missing["LightningDataModule attribute"] = sorted(
        n
        for n in dir(pl.LightningDataModule)
        if not n.startswith("_") and not hasattr(jl.LightningDataModule, n) and n not in not_features
    )
    missing["Callback hook"] = sorted(
        n for n in dir(pl.Callback) if not n.startswith("_") and not hasattr(jl.Callback, n)
    )
    missing["callback"] = sorted(n for n in dir(pl.callbacks) if n[0].isupper() and not hasattr(jl.callbacks, n))
    missing["logger"] = sorted(
        n for n in dir(pl.loggers) if n[0].isupper() and n != "Logger" and not hasattr(jl.loggers, n)
    )
    pl_trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    jl_trainer = jl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    internals = {"fit_loop", "validate_loop", "test_loop", "predict_loop", "val_check_batch", "evaluating"}
    internals |= {"device_ids", "distributed_sampler_kwargs", "num_sanity_val_batches", "enable_validation"}
    internals |= {"early_stopping_callbacks", "profiler", "accelerator"} | set(missing["Trainer argument"])
    have = set(dir(jl_trainer))  # not hasattr: some properties raise outside fit
    missing["Trainer attribute"] = sorted(
        n for n in dir(pl_trainer) if not n.startswith("_") and n not in have and n not in internals
    )
    assert sum(len(v) for v in missing.values()) > 40  # the comparison itself works
    undocumented = {k: [n for n in v if not _documented(n, text)] for k, v in missing.items()}
    assert not any(undocumented.values()), f"migration.md does not mention: {undocumented}"


def test_precision_and_strategy_claims():
    """The precision and strategy rows: aliases map as the table says, refused values raise."""
    assert jl.Trainer(precision="bf16", logger=False).precision == "bf16-mixed"
    assert jl.Trainer(precision=32, logger=False).precision == "32-true"
    for given in ("16-mixed", 16, "16"):
        assert jl.Trainer(precision=given, logger=False).precision_plugin.scaler == jl.GradScaler()
    with pytest.raises(ValueError, match="not supported"):
        jl.Trainer(precision="transformer-engine", logger=False)
    with pytest.raises(jl.MisconfigurationError, match="not a plugin jaxlight has"):
        jl.Trainer(plugins=[object()], logger=False)
    for bad in ("ddp_spawn", "deepspeed_stage_3"):
        with pytest.raises(ValueError, match="unknown strategy"):
            jl.Trainer(strategy=bad, logger=False)
    with pytest.raises(jl.MisconfigurationError, match="devices must be"):
        jl.Trainer(devices="0,1", logger=False)


def test_host_hook_logs_a_float_and_a_mesh_array():
    """One host hook logs a Python float and a mesh-replicated jax array on an 8-device mesh: both reach the
    epoch accumulators (they are moved to one placement before the update)."""
    import optax
    from flax import nnx

    class Norms(jl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            pl_module.log("weight_norm", optax.global_norm(nnx.state(pl_module.net, nnx.Param)))
            pl_module.log("epoch_seen", float(trainer.current_epoch))

    class Reg(jl.LightningModule):
        def configure_model(self):
            self.net = nnx.Linear(4, 1, rngs=nnx.Rngs(0))

        def training_step(self, batch, batch_idx):
            return ((self.net(batch) - 1.0) ** 2).mean()

        def configure_optimizers(self):
            return optax.sgd(0.1)

    t = jl.Trainer(devices=8, max_epochs=1, callbacks=[Norms()], logger=False, enable_checkpointing=False)
    t.fit(Reg(), [np.ones((8, 4), np.float32)] * 2)
    assert float(t.callback_metrics["weight_norm"]) > 0


# --------------------------------------------------------------------------------- the three programs
def _no_pl_noise():
    import logging
    import warnings

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="pytorch_lightning")
    warnings.filterwarnings("ignore", module="torch")


def test_autoencoder_port_stops_and_checkpoints_as_lightning(tmp_path):
    from tests.migration_programs import autoencoder_jaxlight, autoencoder_lightning

    _no_pl_noise()
    init = str(tmp_path / "ae_init.pt")
    ref = autoencoder_lightning.main(str(tmp_path / "pl"), init_weights=init)
    got = autoencoder_jaxlight.main(str(tmp_path / "jl"), init_weights=init)
    # the run must stop by early stopping for the comparison to mean something
    assert ref["stopped_epoch"] > 0 and ref["current_epoch"] < 40
    for k in ("stopped_epoch", "global_step", "current_epoch"):
        assert got[k] == ref[k], k
    name = os.path.basename
    assert name(got["best_model_path"]) == name(ref["best_model_path"])
    assert [name(p) for p in got["best_k_models"]] == [name(p) for p in ref["best_k_models"]]
    assert name(got["last_model_path"]) == name(ref["last_model_path"]) == "last.ckpt"
    assert os.path.isdir(got["best_model_path"]) and os.path.exists(got["last_model_path"])
    assert got["best_model_score"] == pytest.approx(ref["best_model_score"], rel=1e-4)
    assert got["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-4)


def test_cnn_port_fsdp_bf16_matches_lightning(tmp_path):
    from tests.migration_programs import cnn_jaxlight, cnn_lightning

    _no_pl_noise()
    init = str(tmp_path / "cnn_init.pt")
    # Lightning's FSDP needs CUDA: the original runs on the CPU, one device; fp32 and its bf16 autocast
    ref32 = cnn_lightning.main(str(tmp_path / "pl32"), "cpu", "auto", 1, "32-true", init_weights=init)
    ref_bf16 = cnn_lightning.main(str(tmp_path / "plbf"), "cpu", "auto", 1, "bf16-mixed", init_weights=init)
    fsdp32 = cnn_jaxlight.main(str(tmp_path / "jl8"), "fsdp", 8, "32-true", init_weights=init)
    port = cnn_jaxlight.main(str(tmp_path / "jl8bf"), init_weights=init)  # the documented settings
    assert port["mesh"]["fsdp"] == 8 and port["param_dtype"] == "float32"
    steps = 3 * -(-16 // 2)  # 16 batches an epoch, windows of 2, 3 epochs
    for run in (ref32, ref_bf16, fsdp32, port):
        assert run["global_step"] == steps and len(run["losses"]) == 3 * 16
    # FSDP on 8 devices against Lightning on one, step by step. Lightning passes
    # loss / accumulate_grad_batches to on_train_batch_end (documented difference).
    lightning_losses = np.asarray(ref32["losses"]) * 2
    np.testing.assert_allclose(fsdp32["losses"], lightning_losses, rtol=1e-5)
    assert fsdp32["val_acc"] == pytest.approx(ref32["val_acc"], abs=1e-6)
    # BatchNorm's running variance: torch's unbiased update (documented) moves the eval loss a little
    assert fsdp32["val_loss"] == pytest.approx(ref32["val_loss"], rel=1e-3)
    # bf16: the port stays as close to fp32 as Lightning's autocast run does
    bf16_gap = np.abs(np.asarray(port["losses"]) - fsdp32["losses"]).max()
    autocast_gap = np.abs(np.asarray(ref_bf16["losses"]) * 2 - lightning_losses).max()
    assert 0 < bf16_gap < 3e-3 and autocast_gap < 3e-3, (bf16_gap, autocast_gap)
    assert port["val_acc"] == pytest.approx(fsdp32["val_acc"], abs=0.03)
    assert port["losses"][-1] < port["losses"][0]


def _resume_pair(module, root: str, init: str, **kw) -> tuple[dict, dict]:
    crashed = module.main(root, crash_at_step=16, init_weights=init, **kw)
    resumed = module.main(root, resume=True, init_weights=init, **kw)
    return crashed, resumed


@pytest.mark.filterwarnings("ignore:Checkpoint directory")  # the resumed run writes where the first one did
def test_resume_port_continues_as_lightning(tmp_path):
    from tests.migration_programs import resume_jaxlight, resume_lightning

    _no_pl_noise()
    init = str(tmp_path / "init.pt")
    pl_crashed, pl_resumed = _resume_pair(resume_lightning, str(tmp_path / "pl"), init)
    jl_crashed, jl_resumed = _resume_pair(resume_jaxlight, str(tmp_path / "jl"), init)
    assert pl_crashed["global_step"] == jl_crashed["global_step"] == 16
    assert jl_crashed["checkpoints"] == pl_crashed["checkpoints"] == ["epoch=1-step=12.ckpt", "last.ckpt"]
    for k in ("global_step", "current_epoch", "samples", "batches", "checkpoints"):
        assert jl_resumed[k] == pl_resumed[k], k
    assert jl_resumed["samples"] == 30 * 16  # the journal's count carried over the crash
    np.testing.assert_allclose(jl_resumed["epoch_losses"], pl_resumed["epoch_losses"], rtol=1e-5)
    for k in ("weight_norm", "val_loss"):
        assert jl_resumed[k] == pytest.approx(pl_resumed[k], rel=1e-5), k
    # ... and jaxlight's resumed run is the uninterrupted one
    whole = resume_jaxlight.main(str(tmp_path / "jl_whole"), init_weights=init)
    assert whole["batches"] == jl_resumed["batches"]
    for k, v in whole["weights"].items():
        np.testing.assert_array_equal(jl_resumed["weights"][k], v, err_msg=k)


@pytest.mark.filterwarnings("ignore:Checkpoint directory")
def test_resume_port_mid_epoch_is_exact(tmp_path):
    """A checkpoint every 5 steps: the crash at step 16 resumes from step 15, inside epoch 2."""
    from tests.migration_programs import resume_jaxlight, resume_lightning

    _no_pl_noise()
    init = str(tmp_path / "init.pt")
    torch.manual_seed(0)  # the original's initial weights, as its main() makes them
    torch.save(resume_lightning.LitRegressor().state_dict(), init)
    crashed, resumed = _resume_pair(resume_jaxlight, str(tmp_path / "jl"), init, every_n_train_steps=5)
    assert "epoch=2-step=15.ckpt" in crashed["checkpoints"]
    whole = resume_jaxlight.main(str(tmp_path / "whole"), init_weights=init, every_n_train_steps=5)
    assert resumed["batches"] == whole["batches"] and resumed["samples"] == whole["samples"]
    np.testing.assert_allclose(resumed["epoch_losses"], whole["epoch_losses"], rtol=1e-6)
    for k, v in whole["weights"].items():
        np.testing.assert_array_equal(resumed["weights"][k], v, err_msg=k)


def test_links_point_at_existing_pages_and_headings():
    def anchors(md: str) -> set[str]:
        heads = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", md, flags=re.S | re.M), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}

    text = DOC.read_text()
    links = re.findall(r"\]\(([\w.]*\.md)?(?:#([\w\-]+))?\)", text)
    assert len(links) > 20
    for page, anchor in links:
        target = DOC.parent / page if page else DOC
        assert target.exists(), page
        if anchor:
            assert anchor in anchors(target.read_text()), f"{page or 'migration.md'}#{anchor}"
