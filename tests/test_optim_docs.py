"""The runnable examples in docs/optimizers.md run as written and do what they say."""

import re
from pathlib import Path

import numpy as np

DOC = Path(__file__).resolve().parent.parent / "docs" / "optimizers.md"


def test_optimizers_doc_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 3
    ns: dict = {"__name__": "docs_optimizers"}
    for i, code in enumerate(blocks):  # one namespace: later blocks build on earlier ones
        exec(compile(code, f"optimizers.md[block {i}]", "exec"), ns)
        if i == 0:  # the epoch-interval schedule set the injected rate of the last epoch
            state = ns["trainer"].train_state.opt_state
            np.testing.assert_allclose(float(state.hyperparams["learning_rate"]), 0.1 * 0.5**2)
        if i == 1:
            lrs = ns["monitor"].lrs["lr-Adam"]
            np.testing.assert_allclose(lrs, [0.1, 0.1, 0.1, 0.1, 0.05], rtol=1e-6)  # the plateau acted once
    assert ns["trainer"].engine.optimizer.optimizers[1].keys == ("net/l2/bias", "net/l2/kernel")
