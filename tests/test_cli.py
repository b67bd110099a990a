"""LightningCLI: Lightning's config-driven entry point, on jsonargparse.

Each test builds the CLI in this process with ``args=[...]`` (what ``python train.py ...`` would parse)
around the tiny classifier of tests/core_models.py and checks what was built or run: the arguments
that reach the Trainer, the module and the datamodule; the saved config; errors for bad input.
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jaxlight.callbacks import EarlyStopping, Timer
from jaxlight.cli import COMMANDS, LightningCLI, SaveConfigCallback
from jaxlight.cli import main as cli_main
from jaxlight.loggers import CSVLogger
from jaxlight.strategies import FSDP, Strategy, TensorParallel
from tests.cli_models import Classifier, RunRecorder, ToyData
from tests.xla_flags import cpu_xla_flags

ROOT = Path(__file__).resolve().parent.parent
QUIET = [
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.num_sanity_val_steps=0",
]


@pytest.fixture(autouse=True)
def _seed_env_restored(monkeypatch):
    """seed_everything writes PL_GLOBAL_SEED into os.environ; keep it from leaking into other tests."""
    for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)  # restored (to unset, or to what it was) after the test


def _cli(*args: str, **kwargs) -> LightningCLI:
    return LightningCLI(Classifier, ToyData, args=list(args), **kwargs)


def _exit_message(capsys, *args: str, **kwargs) -> str:
    """Run the CLI expecting a parse error: status 2, the message on stderr."""
    with pytest.raises(SystemExit) as e:
        _cli(*args, **kwargs)
    assert e.value.code == 2
    return capsys.readouterr().err


def _weights(module) -> list[np.ndarray]:
    from flax import nnx

    if not hasattr(module, "net"):
        module.configure_model()
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(module.net, nnx.Param))]


def _saved_config(root: Path) -> dict:
    (path,) = root.glob("lightning_logs/version_*/config.yaml")
    return yaml.safe_load(path.read_text())


# ============================================================================ fit from config files and options
def test_fit_from_config_file_and_options(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "seed_everything": 3,
                "trainer": {
                    "max_steps": 10,  # overridden below: later sources win
                    "log_every_n_steps": 1,
                    "default_root_dir": str(tmp_path / "root"),
                    "callbacks": [
                        {"class_path": "jaxlight.callbacks.EarlyStopping", "init_args": {"monitor": "train_loss"}},
                        {"class_path": "tests.cli_models.RunRecorder"},
                    ],
                    "logger": {
                        "class_path": "jaxlight.loggers.CSVLogger",
                        "init_args": {"save_dir": str(tmp_path / "root")},
                    },
                },
                "model": {"lr": 0.05, "opt": "sgd"},
                "data": {"n": 64, "batch_size": 16},
            }
        )
    )
    cli = _cli(
        "fit",
        "--config",
        str(cfg),
        *QUIET,
        "--trainer.max_steps=3",
        "--trainer.callbacks+=jaxlight.callbacks.Timer",  # appended to the config's list
        "--trainer.callbacks.interval=epoch",  # init args of the callback given last
        "--model.lr=0.1",
        "--data.batch_size=8",
    )
    trainer, model, dm = cli.trainer, cli.model, cli.datamodule
    assert cli.subcommand == "fit" and trainer.global_step == 3  # it ran fit
    assert isinstance(model, Classifier) and dict(model.hparams) == {
        "lr": 0.1,
        "dropout": 0.0,
        "batchnorm": False,
        "opt": "sgd",
    }
    assert isinstance(dm, ToyData) and dm.batch_size == 8
    es = [c for c in trainer.callbacks if isinstance(c, EarlyStopping)]
    timers = [c for c in trainer.callbacks if isinstance(c, Timer)]
    assert len(es) == 1 and es[0].monitor == "train_loss" and es[0].patience == 3
    assert len(timers) == 1 and timers[0].interval == "epoch"
    rec = next(c for c in trainer.callbacks if isinstance(c, RunRecorder))
    assert len(rec.losses) == 3
    assert isinstance(trainer.logger, CSVLogger) and trainer.log_every_n_steps == 1
    assert os.environ["PL_GLOBAL_SEED"] == "3"
    # the merged config is saved next to the metrics, loadable with a safe loader
    saved = _saved_config(tmp_path / "root")
    assert saved["seed_everything"] == 3 and saved["trainer"]["max_steps"] == 3
    assert saved["model"] == {"lr": 0.1, "dropout": 0.0, "batchnorm": False, "opt": "sgd"}
    assert [c["class_path"] for c in saved["trainer"]["callbacks"]] == [
        "jaxlight.callbacks.EarlyStopping",
        "tests.cli_models.RunRecorder",
        "jaxlight.callbacks.Timer",
    ]
    assert (tmp_path / "root" / "lightning_logs" / "version_0" / "metrics.csv").exists()


def test_saved_config_reproduces_the_run(tmp_path):
    """Running the saved config.yaml again builds the same classes with the same values and seed."""
    first = _cli(
        "fit", *QUIET, "--trainer.max_steps=2", f"--trainer.default_root_dir={tmp_path / 'a'}", "--model.lr=0.2"
    )
    drawn = first.config.fit.seed_everything
    assert isinstance(drawn, int) and not isinstance(drawn, bool)  # seed_everything=True drew one
    saved = next((tmp_path / "a").glob("lightning_logs/version_*/config.yaml"))
    again = _cli("fit", "--config", str(saved), "--trainer.max_steps=0", f"--trainer.default_root_dir={tmp_path / 'b'}")
    assert again.config.fit.seed_everything == drawn and os.environ["PL_GLOBAL_SEED"] == str(drawn)
    assert dict(again.model.hparams) == dict(first.model.hparams)


def test_print_config_prints_the_merged_config_and_runs_nothing(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("trainer:\n  max_steps: 10\nmodel:\n  lr: 0.5\n")
    with pytest.raises(SystemExit) as e:
        _cli(
            "fit",
            "--config",
            str(cfg),
            "--model.dropout=0.25",
            f"--trainer.default_root_dir={tmp_path}",
            "--print_config",
        )
    assert e.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_steps"] == 10 and printed["model"] == {
        "lr": 0.5,
        "dropout": 0.25,
        "batchnorm": False,
        "opt": "adam",
    }
    assert printed["data"] == {"n": 64, "batch_size": 16, "seed": 0} and printed["ckpt_path"] is None
    assert not (tmp_path / "lightning_logs").exists()


def test_help_lists_trainer_model_data_and_method_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        _cli("fit", "--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--config", "--print_config", "--seed_everything", "--trainer.max_epochs", "--trainer.strategy"):
        assert opt in out
    for opt in ("--trainer.callbacks", "--model.lr", "--data.batch_size", "--ckpt_path"):
        assert opt in out
    with pytest.raises(SystemExit):
        _cli("--help")
    top = capsys.readouterr().out
    assert all(s in top for s in ("fit", "validate", "test", "predict"))


# ============================================================================ strategies by name, class path or list
def test_strategy_by_name_class_path_and_list(tmp_path):
    cli = _cli("--trainer.strategy=fsdp+tp", run=False)
    assert dict(cli.trainer.mesh.shape)["fsdp"] == 4 and dict(cli.trainer.mesh.shape)["tensor"] == 2

    cli = _cli(
        "--trainer.strategy=jaxlight.strategies.FSDP",
        "--trainer.strategy.size=4",
        "--trainer.strategy.min_shard=64",
        run=False,
    )
    assert cli.trainer.strategy == FSDP(min_shard=64, size=4).as_strategy()
    assert {k: v for k, v in cli.trainer.mesh.shape.items() if v > 1} == {"data": 2, "fsdp": 4}

    cfg = tmp_path / "pieces.yaml"
    cfg.write_text(
        "trainer:\n  strategy:\n"
        "    - class_path: jaxlight.strategies.FSDP\n      init_args: {min_shard: 64}\n"
        "    - class_path: jaxlight.strategies.TensorParallel\n      init_args: {size: 2}\n"
    )
    cli = _cli("--config", str(cfg), run=False)
    assert cli.trainer.strategy == FSDP(min_shard=64) + TensorParallel(2)
    assert isinstance(cli.trainer.strategy, Strategy) and dict(cli.trainer.mesh.shape)["tensor"] == 2


# ============================================================================ errors before anything runs
def test_unknown_and_mistyped_options_are_errors_with_suggestions(capsys, tmp_path):
    root = f"--trainer.default_root_dir={tmp_path}"
    err = _exit_message(capsys, "fit", root, "--trainer.max_epoch=3")  # a prefix is not accepted either
    assert "unrecognized arguments: --trainer.max_epoch" in err and "did you mean --trainer.max_epochs" in err
    err = _exit_message(capsys, "fit", root, "--model.lrr=0.1")
    assert "--model.lrr" in err and "did you mean --model.lr" in err
    err = _exit_message(capsys, "fit", root, "--trainer.max_epochs=three")
    assert 'Parser key "trainer.max_epochs"' in err and "three" in err
    err = _exit_message(capsys, "fit", root, "--trainer.strategy=fsdpp")
    assert "unknown strategy 'fsdpp'" in err and "'fsdp'" in err
    err = _exit_message(capsys, "fit", root, "--trainer.callbacks+=jaxlight.callbacks.EarlyStoping")
    assert "jaxlight.callbacks.EarlyStoping" in err
    err = _exit_message(capsys, "fitt")
    assert "invalid choice: 'fitt'" in err
    err = _exit_message(capsys)
    assert 'expected "subcommand" to be one of {fit,validate,test,predict}' in err
    err = _exit_message(capsys, root, "fit")
    assert (
        "--trainer.default_root_dir is an option of the subcommands fit, validate, test, predict: give it after" in err
    )
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("trainer:\n  max_step: 3\n")
    err = _exit_message(capsys, "fit", "--config", str(cfg))
    assert "trainer.max_step" in err and "did you mean --trainer.max_steps" in err
    assert not (tmp_path / "lightning_logs").exists()  # nothing was built or run


def test_config_files_cannot_run_code(capsys, tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f'trainer: !!python/object/apply:os.system ["touch {marker}"]\n')
    err = _exit_message(capsys, "fit", "--config", str(evil))
    assert "python/object/apply:os.system" in err and not marker.exists()  # YAML's safe loader refuses the tag
    # class paths may only name subclasses of the annotated type
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f'trainer:\n  callbacks:\n    - class_path: subprocess.Popen\n      init_args: {{args: ["touch", "{marker}"]}}\n'
    )
    err = _exit_message(capsys, "fit", "--config", str(bad))
    assert "subprocess.Popen" in err and not marker.exists()
    err = _exit_message(capsys, "fit", "--trainer.logger=os.system")
    assert "os.system" in err


# ============================================================================ defaults, seeds, hooks, modes
def test_trainer_defaults_are_defaults_and_their_callbacks_always_added(capsys, tmp_path):
    rec = RunRecorder()
    defaults = {"max_steps": 2, "enable_progress_bar": False, "callbacks": [rec], "default_root_dir": str(tmp_path)}
    with pytest.raises(SystemExit):
        _cli("fit", "--print_config", trainer_defaults=defaults)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_steps"] == 2 and printed["trainer"]["callbacks"] is None  # not configurable
    cli = _cli(
        "fit",
        *QUIET,
        "--trainer.max_steps=3",
        "--trainer.callbacks+=jaxlight.callbacks.Timer",
        trainer_defaults=defaults,
    )
    assert cli.trainer.global_step == 3 and len(rec.losses) == 3  # the option won over the default
    kinds = [type(c) for c in cli.trainer.callbacks]
    assert kinds.index(Timer) < kinds.index(RunRecorder) < kinds.index(SaveConfigCallback)


def test_seed_everything(monkeypatch):
    cli = _cli("--seed_everything=123", run=False)
    assert cli.config.seed_everything == 123 and os.environ["PL_GLOBAL_SEED"] == "123"
    monkeypatch.delenv("PL_GLOBAL_SEED")
    seeds = []
    for _ in range(2):  # default True: a random seed, recorded in the config and the environment
        seeds.append(_cli(run=False).config.seed_everything)
        assert os.environ.pop("PL_GLOBAL_SEED") == str(seeds[-1])
    assert all(isinstance(s, int) and 0 <= s < 2**31 for s in seeds) and seeds[0] != seeds[1]
    monkeypatch.setenv("PL_GLOBAL_SEED", "77")  # as Lightning: a seed in the environment is the one drawn
    assert _cli(run=False).config.seed_everything == 77
    monkeypatch.delenv("PL_GLOBAL_SEED")
    cli = _cli(run=False, seed_everything_default=False)
    assert cli.config.seed_everything is False and "PL_GLOBAL_SEED" not in os.environ


def test_run_false_builds_the_classes_for_the_script(tmp_path):
    cli = _cli(*QUIET, "--trainer.max_steps=2", "--model.lr=0.3", f"--trainer.default_root_dir={tmp_path}", run=False)
    assert cli.subcommand is None and cli.trainer.global_step == 0  # nothing ran
    assert cli.trainer.max_steps == 2 and cli.model.hparams.lr == 0.3 and isinstance(cli.datamodule, ToyData)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2 and _saved_config(tmp_path)["model"]["lr"] == 0.3


def test_validate_test_predict_and_resume_with_ckpt_path(tmp_path):
    root = f"--trainer.default_root_dir={tmp_path}"
    fit = _cli("fit", *QUIET, root, "--trainer.max_steps=4", "--trainer.callbacks+=jaxlight.callbacks.ModelCheckpoint")
    assert fit.trainer.global_step == 4
    val = _cli("validate", *QUIET, root, "--ckpt_path=last", save_config_callback=None)
    assert "val_acc" in val.trainer.callback_metrics
    trained, restored, fresh = (_weights(m) for m in (fit.model, val.model, Classifier()))
    assert all(np.array_equal(a, b) for a, b in zip(trained, restored))  # validated the checkpoint's weights
    assert not all(np.array_equal(a, b) for a, b in zip(trained, fresh))
    test = _cli("test", *QUIET, root, "--ckpt_path=last", "--verbose=false", save_config_callback=None)
    assert "test_acc" in test.trainer.callback_metrics
    assert all(np.array_equal(a, b) for a, b in zip(trained, _weights(test.model)))  # tested the checkpoint
    pred = _cli("predict", *QUIET, root, save_config_callback=None)
    assert pred.trainer.num_predict_batches == 2
    resumed = _cli(
        "fit",
        *QUIET,
        root,
        "--trainer.max_steps=6",
        "--ckpt_path=last",
        "--trainer.callbacks+=tests.cli_models.RunRecorder",
    )
    (rec,) = [c for c in resumed.trainer.callbacks if type(c).__name__ == "RunRecorder"]
    # continued from step 4: two more steps ran (a fresh run would have run six)
    assert resumed.trainer.global_step == 6 and len(rec.losses) == 2


def test_save_config_callback_refuses_to_overwrite(tmp_path):
    logger = [
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=jaxlight.loggers.CSVLogger",
        f"--trainer.logger.save_dir={tmp_path}",
        "--trainer.logger.version=0",
    ]
    _cli("fit", *QUIET, *logger, "--trainer.max_steps=1")
    saved = tmp_path / "lightning_logs" / "version_0" / "config.yaml"
    first = saved.read_text()
    with pytest.raises(RuntimeError, match=r"expected .*config.yaml to not exist"):
        _cli("fit", *QUIET, *logger, "--trainer.max_steps=2")
    assert saved.read_text() == first
    _cli("fit", *QUIET, *logger, "--trainer.max_steps=2", save_config_kwargs={"overwrite": True})
    assert yaml.safe_load(saved.read_text())["trainer"]["max_steps"] == 2
    saved.unlink()
    _cli("fit", *QUIET, *logger, "--trainer.max_steps=1", save_config_callback=None)
    assert not saved.exists()
    _cli("fit", *QUIET, *logger, "--trainer.fast_dev_run=true")  # Lightning: no config for fast_dev_run
    assert not saved.exists()


def test_subclass_mode_links_and_extra_callbacks(tmp_path):
    class CLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_lightning_class_args(EarlyStopping, "early_stopping")
            parser.set_defaults({"early_stopping.monitor": "val_acc", "early_stopping.patience": 5})
            parser.link_arguments("data.batch_size", "trainer.log_every_n_steps")

    cli = CLI(
        None,  # any LightningModule by class path
        ToyData,
        args=[
            "--model=tests.cli_models.Classifier",
            "--model.lr=0.4",
            "--data.batch_size=8",
            "--early_stopping.patience=9",
        ],
        run=False,
    )
    assert isinstance(cli.model, Classifier) and cli.model.hparams.lr == 0.4
    es = [c for c in cli.trainer.callbacks if isinstance(c, EarlyStopping)]
    assert len(es) == 1 and es[0].monitor == "val_acc" and es[0].patience == 9
    assert cli.trainer.log_every_n_steps == 8  # linked from the data
    with pytest.raises(SystemExit):
        LightningCLI(None, ToyData, args=["--model=tests.cli_models.ToyData"], run=False)  # not a LightningModule


def test_before_and_after_hooks_and_subcommand_override(tmp_path):
    calls = []

    class CLI(LightningCLI):
        def before_fit(self):
            calls.append(("before", self.trainer.global_step))

        def after_fit(self):
            calls.append(("after", self.trainer.global_step))

        def validate(self, model, datamodule=None, **kwargs):
            calls.append(("validate", type(model).__name__, type(datamodule).__name__, kwargs))

    CLI(Classifier, ToyData, args=["fit", *QUIET, "--trainer.max_steps=2", f"--trainer.default_root_dir={tmp_path}"])
    CLI(Classifier, ToyData, args=["validate", *QUIET, "--ckpt_path=x"], save_config_callback=None)
    assert calls == [
        ("before", 0),
        ("after", 2),
        ("validate", "Classifier", "ToyData", {"ckpt_path": "x", "verbose": True}),
    ]


def test_gpt_example_links_seq_len_and_schedule():
    from examples.gpt_cli import main as gpt_main

    cli = gpt_main(
        [
            "--config",
            str(ROOT / "examples/gpt_cli.yaml"),
            "--data.seq_len=24",
            "--trainer.max_steps=7",
            "--data.data_bytes=20000",
        ],
        run=False,
    )
    assert cli.model.hparams.seq_len == 24 == cli.datamodule.seq_len and cli.model.hparams.max_steps == 7
    assert cli.trainer.max_steps == 7 and cli.model.hparams.d_model == 128


# ============================================================================ docs/cli.md
def test_docs_cli_example_runs_as_written(tmp_path):
    """docs/cli.md's train.py and config.yaml, run with the command the page shows."""
    text = (ROOT / "docs" / "cli.md").read_text()
    script = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    config = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)[0]
    command = shlex.split(re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0].strip())
    assert (
        script.startswith("# train.py") and config.startswith("# config.yaml") and command[:2] == ["python", "train.py"]
    )
    (tmp_path / "train.py").write_text(script)
    (tmp_path / "config.yaml").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(8))
    r = subprocess.run(
        [sys.executable, *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    saved = _saved_config(tmp_path)
    assert saved["model"] == {"hidden": 64, "lr": 3e-3} and saved["data"] == {"batch_size": 16, "batches": 8, "seed": 0}
    assert saved["trainer"]["callbacks"][0]["class_path"] == "jaxlight.callbacks.EarlyStopping"
    with open(next(tmp_path.glob("lightning_logs/version_0/metrics.csv"))) as f:
        rows = [row for row in csv.DictReader(f) if row.get("train_loss")]
    # 2 epochs of 128 / 16 = 8 batches, logged every 4 steps; the regression learns
    assert [int(row["step"]) for row in rows] == [3, 7, 11, 15]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])


# ============================================================================ the console script
def test_console_script_commands(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    out = capsys.readouterr().out
    assert "plot" in out and "launch" in out

    def hello(sub):
        p = sub.add_parser("hello", help="say hello")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda a: print(f"hello {a.name}") or 7)

    # the console script reads the list of jaxlight/cli/main.py (`jaxlight.cli.main` is the function)
    monkeypatch.setattr(sys.modules["jaxlight.cli.main"], "COMMANDS", [*COMMANDS, hello])
    assert cli_main(["hello", "--name", "jax"]) == 7 and capsys.readouterr().out == "hello jax\n"


def test_importing_the_cli_imports_no_jsonargparse():
    code = "import sys, jaxlight.cli; print('jsonargparse' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "False"
