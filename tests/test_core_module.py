"""LightningModule API outside the loop: save_hyperparameters (Lightning's rules), trainer access."""

import pytest

import jaxlight as jl


class Base(jl.LightningModule):
    def __init__(self, lr=0.1, net=None, depth=2):
        super().__init__()
        self.save_hyperparameters(ignore="net")


class Derived(Base):
    def __init__(self, lr=0.5, width=8, **kwargs):
        super().__init__(lr=lr / 10, **kwargs)  # the derived class's own value is what Lightning records


def test_save_hyperparameters_rules():
    assert dict(Base(0.3, net=object()).hparams) == {"lr": 0.3, "depth": 2}
    hp = Derived(lr=0.2, depth=4).hparams
    assert dict(hp) == {"lr": 0.2, "width": 8, "depth": 4}
    assert hp.lr == 0.2 and hp["width"] == 8
    with pytest.raises(AttributeError, match=r"no hyperparameter 'nope'; saved: \['depth', 'lr', 'width'\]"):
        hp.nope

    class Picked(jl.LightningModule):
        def __init__(self, a, b=2, *args, **kwargs):
            super().__init__()
            self.save_hyperparameters("a")

    assert dict(Picked(1).hparams) == {"a": 1}

    class Given(jl.LightningModule):
        def __init__(self, cfg):
            super().__init__()
            self.save_hyperparameters(cfg)

    assert dict(Given({"lr": 1e-3, "layers": 3}).hparams) == {"lr": 1e-3, "layers": 3}

    class Missing(jl.LightningModule):
        def __init__(self, a=1):
            super().__init__()
            self.save_hyperparameters("b")

    with pytest.raises(ValueError, match=r"\['b'\] are not arguments of __init__ \(have \['a'\]\)"):
        Missing()


def test_trainer_access_and_log_outside_a_run():
    m = Base()
    with pytest.raises(RuntimeError, match="Base is not attached to a Trainer"):
        m.trainer
    with pytest.raises(RuntimeError, match="self.log was called outside a Trainer run"):
        m.log("x", 1.0)
    assert m.global_step == 0 and m.current_epoch == 0
