"""The runnable examples in docs/callbacks.md and docs/logging.md run as written and do what they say."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_blocks(name: str) -> list[str]:
    text = (DOCS / name).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("doc", ["callbacks.md", "logging.md"])
def test_doc_examples_run(doc, tmp_path, capsys):
    blocks = python_blocks(doc)
    assert blocks, f"{doc} has no python example"
    ns: dict = {"__name__": f"docs_{doc.split('.')[0]}"}
    for i, code in enumerate(blocks):  # one namespace per page: later blocks build on earlier ones
        exec(compile(code, f"{doc}[block {i}]", "exec"), ns)
    out = capsys.readouterr().out
    if doc == "callbacks.md":
        assert "samples/s" in out and ns["speed"].flops_per_step > 0
        assert ns["averaged"] and ns["early"].best_score < float("inf")
        assert int(ns["trainer"].train_state.callback_state["update_count"]) == len(ns["train"]) // 2
        assert list(Path("logs/profile/plugins/profile").glob("*/*.xplane.pb"))
    else:
        steps = [m.step for m in ns["history"]]
        assert len(steps) == 3 and steps == sorted(steps)  # one val_loss per epoch, in step order
        assert {p.name for p in ns["pngs"]} >= {"train_loss_step.png", "train_loss_epoch.png", "val_loss.png"}
