"""The README's example must run as printed (the front door stays true)."""

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_does_bptt(capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    loss_text, shape_text = out.splitlines()[0].split(" ", 1)
    g, loss = namespace["g"], namespace["loss"]
    assert float(loss_text) == namespace["cg"].node(loss).value  # the printed loss is the graph's
    assert shape_text == "(16, 16)"
    assert np.abs(g.params["W_h"].grad).sum() > 0  # gradients flowed back through time
    assert "<Tanh:1@6>" in out  # the carry entering iteration 7 is iteration 6's tanh
