"""ProfilerWindow writes one trace per fit holding exactly `steps` annotated train steps, after the compile."""

import glob
import os

import pytest
from jax.profiler import ProfileData

import jaxlight as jl
from jaxlight.callbacks import ProfilerWindow
from tests.core_models import Classifier, batches, make_data, quiet


def traced_steps(xplane: str) -> list[int]:
    """step_num of every "train" StepTraceAnnotation event in an .xplane.pb."""
    steps = []
    for plane in ProfileData.from_file(xplane).planes:
        for line in plane.lines:
            for ev in line.events:
                if ev.name == "train":
                    stats = dict(ev.stats)
                    steps.append(int(stats["step_num"]))
    return sorted(steps)


def test_window_holds_the_loop_not_the_compile(tmp_path):
    data = batches(*make_data(160), 16)  # 10 batches
    prof = ProfilerWindow(tmp_path / "prof", warmup=2, steps=5)
    trainer = jl.Trainer(max_epochs=1, devices=8, callbacks=[prof], **quiet())
    trainer.fit(Classifier(), data)
    runs = glob.glob(str(tmp_path / "prof" / "plugins" / "profile" / "*"))
    assert len(runs) == 1 and prof.trace_dir == runs[0]
    xplanes = glob.glob(os.path.join(runs[0], "*.xplane.pb"))
    assert len(xplanes) == 1 and glob.glob(os.path.join(runs[0], "*.trace.json.gz"))  # Perfetto/TensorBoard
    # steps 2..6: the first two (with the compile) are outside the window
    assert traced_steps(xplanes[0]) == [2, 3, 4, 5, 6]
    names = [
        ev.name for plane in ProfileData.from_file(xplanes[0]).planes for line in plane.lines for ev in line.events
    ]
    # five executions of the compiled train step, and no compilation inside the window
    assert sum(n.startswith("CommonPjRtLoadedExecutable::Execute (jit_train_step)") for n in names) == 5
    assert "backend_compile_and_load" not in names


def test_short_fit_stops_the_trace_at_train_end(tmp_path):
    data = batches(*make_data(64), 16)  # 4 batches: window 1..3 cut to 1..3
    prof = ProfilerWindow(tmp_path / "p", warmup=1, steps=10)
    jl.Trainer(max_epochs=1, devices=1, callbacks=[prof], **quiet()).fit(Classifier(), data)
    xplane = glob.glob(os.path.join(prof.trace_dir, "*.xplane.pb"))[0]
    assert traced_steps(xplane) == [1, 2, 3]
    # the profiler is free again: a second fit traces again
    prof2 = ProfilerWindow(tmp_path / "p2", warmup=0, steps=2)
    # a program the persistent compile cache has not seen (the first fit cached its own), so it compiles
    jl.Trainer(max_epochs=1, devices=1, callbacks=[prof2], **quiet()).fit(Classifier(dropout=0.25), data)
    xplane2 = glob.glob(os.path.join(prof2.trace_dir, "*.xplane.pb"))[0]
    assert traced_steps(xplane2) == [0, 1]
    # warmup=0 puts the compile in the window: the check above would see it
    assert any(
        ev.name == "backend_compile_and_load"
        for plane in ProfileData.from_file(xplane2).planes
        for line in plane.lines
        for ev in line.events
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        ProfilerWindow("x", warmup=0, steps=0)
