"""ModelSummary rows against the model's real arrays; Timer and LambdaCallback semantics."""

import pytest

import jaxlight as jl
from jaxlight.callbacks import LambdaCallback, ModelSummary, Timer
from tests.core_models import HID, IN, OUT, Classifier, batches, make_data, quiet

DATA = batches(*make_data(64), 16)


def test_model_summary_counts_bytes_and_sharding(capsys):
    summ = ModelSummary(max_depth=2)
    trainer = jl.Trainer(
        max_epochs=1,
        devices=8,
        strategy=jl.strategies.FSDP(min_shard=1),
        callbacks=[summ],
        **quiet(enable_model_summary=True),
    )
    trainer.fit(Classifier(), DATA)
    rows = {r["name"]: r for r in summ.rows}
    assert list(rows) == ["net", "net/l1", "net/l2"]
    assert rows["net/l1"]["type"] == "Linear" and rows["net"]["type"] == "MLP"
    assert rows["net/l1"]["params"] == IN * HID + HID
    assert rows["net/l2"]["params"] == HID * OUT + OUT
    assert rows["net"]["params"] == rows["net/l1"]["params"] + rows["net/l2"]["params"]
    params = trainer.train_state.params
    for name in ("net/l1", "net/l2"):
        arrays = [v for k, v in params.items() if k.startswith(name + "/")]
        per_dev = {}
        for a in arrays:
            for s in a.addressable_shards:
                per_dev[s.device] = per_dev.get(s.device, 0) + s.data.nbytes
        assert rows[name]["bytes_per_device"] == max(per_dev.values())
        assert rows[name]["sharding"] == sorted({str(a.sharding.spec) for a in arrays})
    # sharded: the fullest device holds less than the whole module
    assert rows["net"]["bytes_per_device"] < 4 * rows["net"]["params"]
    out = capsys.readouterr().out
    assert out.count("Mesh:") == 1 and "net/l1" in out  # the callback's table replaced the default one


def test_model_summary_depth_one_and_conflict():
    summ = ModelSummary()
    jl.Trainer(max_epochs=1, devices=1, callbacks=[summ], **quiet(enable_model_summary=True)).fit(Classifier(), DATA)
    assert [r["name"] for r in summ.rows] == ["net"]
    with pytest.raises(ValueError, match="enable_model_summary=False"):
        jl.Trainer(max_epochs=1, devices=1, callbacks=[ModelSummary()], **quiet()).fit(Classifier(), DATA)


def test_timer_stops_and_keeps_elapsed_time():
    timer = Timer(duration={"seconds": 0})
    trainer = jl.Trainer(max_epochs=3, devices=1, callbacks=[timer], **quiet())
    trainer.fit(Classifier(), DATA)
    # a budget already spent at fit start: Lightning trains nothing and the timer measured nothing
    assert trainer.global_step == 0 and trainer.should_stop
    assert timer.state_dict()["time_elapsed"] == 0
    resumed = Timer(duration="00:00:00:05")
    resumed.load_state_dict({"time_elapsed": 3.0})
    assert resumed.time_elapsed() == 3.0 and resumed.duration.total_seconds() == 5
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        Timer(duration="5 minutes")


def test_lambda_callback_calls_hooks_in_order():
    calls = []
    cb = LambdaCallback(
        on_fit_start=lambda t, m: calls.append("fit_start"),
        on_train_epoch_start=lambda t, m: calls.append(f"epoch{t.current_epoch}"),
        on_train_batch_end=lambda t, m, out, batch, idx: calls.append(idx),
        on_fit_end=lambda t, m: calls.append("fit_end"),
    )
    jl.Trainer(max_epochs=2, devices=1, callbacks=[cb], **quiet()).fit(Classifier(), DATA)
    assert calls == ["fit_start", "epoch0", 0, 1, 2, 3, "epoch1", 0, 1, 2, 3, "fit_end"]
    with pytest.raises(ValueError, match="not a Callback hook"):
        LambdaCallback(on_train_batch_ending=print)
