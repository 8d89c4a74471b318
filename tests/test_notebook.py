"""What a Jupyter notebook shows: a cell ending in ``g.train()`` / ``g.eval()`` shows nothing, and
the progress bar is the widget when ipywidgets works and otherwise the text bar, quietly.

The notebook is simulated (a kernel's shell class, ``ipykernel.zmqshell`` imported, as tqdm and
vgraph detect it), as are a missing or broken ipywidgets; no Jupyter is needed.
"""

from __future__ import annotations

import gc
import re
import sys
import types
import warnings
from typing import Any

import numpy as np
import pytest

import vgraph as vg
from vgraph.tbptt import Progress

# ---------------------------------------------------------------------------- train() / eval()


def test_train_and_eval_switch_the_mode_and_return_none():
    g = vg.VirtualGraph(dtype=np.float64)
    # Returning None, a call that ends a notebook cell shows nothing (a graph would be drawn).
    assert g.eval() is None
    assert g.training is False
    assert g.train() is None
    assert g.training is True
    assert g.train(False) is None
    assert g.training is False
    with pytest.raises(
        vg.errors.ArgumentError, match=r"train\(mode=...\) must be True or False, got str 'eval'"
    ):
        g.train("eval")  # type: ignore[arg-type]
    assert g.training is False  # a failed call changes nothing


def test_a_cell_ending_in_train_or_eval_displays_nothing(tmp_path, monkeypatch):
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell(config=config)
    g = vg.VirtualGraph(name="model")
    g.input("x", shape=(2,))
    shell.user_ns["g"] = g
    try:
        for cell in ("g.eval()", "g.train()", "g.train(False)"):
            result = shell.run_cell(cell)
            assert result.success and result.result is None, cell  # the display hook got nothing
        # The graph alone in a cell still shows itself (drawn when Graphviz is installed).
        assert shell.run_cell("g").result is g
        data, _ = shell.display_formatter.format(g)
        assert data["text/plain"].startswith(repr(g))
    finally:
        shell.cleanup()


# ---------------------------------------------------------------------------- the progress bar


class ZMQInteractiveShell:
    """Stands for the shell of a Jupyter kernel (only its class name is looked at)."""


class Widget:
    """Stands for an ipywidgets widget: takes any attribute."""

    def __init__(self, **attrs: Any) -> None:
        self.value: Any = ""
        self.bar_style = ""
        self.__dict__.update(attrs)
        self.layout = types.SimpleNamespace()
        self.style = types.SimpleNamespace()


class BrokenWidget:
    """An ipywidgets widget that cannot be made (e.g. a front end without the widget manager)."""

    def __init__(self, **attrs: Any) -> None:
        raise RuntimeError("no widget manager in this front end")


def module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


@pytest.fixture
def notebook(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A simulated Jupyter kernel; returns the list of objects passed to IPython's display().

    tqdm's modules are dropped from sys.modules (and put back afterwards), so that they decide
    again, in this environment, what they can show.
    """
    shown: list[Any] = []
    shell = ZMQInteractiveShell()
    display = module("IPython.display", display=shown.append)
    ipython = module("IPython", get_ipython=lambda: shell, display=display, __path__=[])
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    monkeypatch.setitem(sys.modules, "ipykernel", module("ipykernel", __path__=[]))
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", module("ipykernel.zmqshell"))
    for name in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return shown


def run_bar(capsys: pytest.CaptureFixture[str]) -> tuple[Progress, str, str, list[str]]:
    """Five steps of a Progress bar: (it, stdout, stderr, warnings and unraisable errors)."""
    problems: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: problems.append(f"unraisable in {u.object!r}: {u.exc_value!r}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Progress(5, desc="train") as progress:
                for _ in range(5):
                    progress.update(loss=0.5)
            gc.collect()  # a half-made bar would complain when collected
    finally:
        sys.unraisablehook = hook
    problems += [f"{w.category.__name__}: {w.message}" for w in caught]
    out, err = capsys.readouterr()
    return progress, out, err, problems


def assert_only_the_text_bar(err: str) -> None:
    """stderr holds the bar's redraws and nothing else."""
    frames = [f for f in re.split(r"[\r\n]", err) if f.strip()]
    assert frames, "no bar drawn"
    assert all(f.startswith("train:") for f in frames), err
    assert "5/5" in frames[-1] and "loss 0.5" in frames[-1]


def test_notebook_without_ipywidgets_shows_the_text_bar_quietly(notebook, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # `import ipywidgets` raises ImportError
    progress, out, err, problems = run_bar(capsys)
    assert problems == []
    assert progress.mode == "bar" and out == "" and notebook == []
    assert_only_the_text_bar(err)


def test_notebook_whose_widget_fails_shows_the_text_bar_quietly(notebook, monkeypatch, capsys):
    broken = module("ipywidgets", HTML=BrokenWidget, FloatProgress=BrokenWidget, HBox=Widget)
    monkeypatch.setitem(sys.modules, "ipywidgets", broken)
    progress, out, err, problems = run_bar(capsys)
    assert problems == []
    assert progress.mode == "bar" and out == "" and notebook == []
    assert_only_the_text_bar(err)


def test_notebook_with_ipywidgets_shows_the_widget(notebook, monkeypatch, capsys):
    monkeypatch.setitem(
        sys.modules, "ipywidgets", module("ipywidgets", HTML=Widget, FloatProgress=Widget, HBox=Widget)
    )
    progress, out, err, problems = run_bar(capsys)
    assert problems == []
    assert progress.mode == "bar" and err == ""
    (container,) = notebook  # the widget, displayed once
    _, bar, right = container.children
    assert bar.max == 5 and bar.value == 5 and "loss 0.5" in right.value.replace("\u2007", " ")
