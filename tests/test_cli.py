"""The command line's own options (``python -m vgraph --version``) and what ``render`` leaves on
disk (a drawing whole or no file); what ``render`` draws is tested in test_render*.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_render import require_dot

import vgraph as vg
from vgraph.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version_option_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"vgraph {vg.__version__}\n"


def test_python_dash_m_vgraph_version():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "vgraph", "--version"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"vgraph {vg.__version__}"


# ---------------------------------------------------------------------------- render's output file

UNTIL_MODEL = """
import numpy as np
import vgraph as vg


def converged(t, state):
    return float(np.abs(state["z"]).max()) < 0.1


def build():
    g = vg.VirtualGraph(dtype=np.float64, name="halving")
    x = g.input("x", shape=(3,))
    with g.loop(until=converged, max_iters=50) as loop:
        z = loop.carry(x, name="z")
        loop.update(z, z * 0.5)
    return g, {"x": np.ones(3)}, [loop.final(z).sum()]
"""

# A `dot` that fails halfway: it writes the start of a drawing (to -o FILE if given, as the real
# one does, else to stdout), then an error, and exits 1.
FAILING_DOT = """
import sys

sys.stdin.read()
partial = b'<?xml version="1.0"?><svg width="'
args = sys.argv[1:]
if "-o" in args:
    with open(args[args.index("-o") + 1], "wb") as f:
        f.write(partial)
else:
    sys.stdout.buffer.write(partial)
sys.stderr.write("Error: syntax error in line 1\\n")
sys.exit(1)
"""


def model_script(tmp_path: Path) -> Path:
    script = tmp_path / "until_model.py"
    script.write_text(UNTIL_MODEL)
    return script


@pytest.fixture
def failing_dot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PATH holds only a `dot` that fails after writing part of its output."""
    if os.name == "nt":
        pytest.skip("the fake `dot` is a script with a #! line")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    dot = bin_dir / "dot"
    dot.write_text(f"#!{sys.executable}\n{FAILING_DOT}")
    dot.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_render_draws_a_loop_declared_with_until(tmp_path, capsys):
    require_dot()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model.svg"
    assert main(["render", str(model_script(tmp_path)), "-o", str(out)]) == 0, capsys.readouterr().err
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and text.rstrip().endswith("</svg>")
    assert "until converged (checked after each iteration)" in text
    assert [p.name for p in out_dir.iterdir()] == ["model.svg"]  # no temporary file left behind


def test_failed_render_leaves_no_partial_file(failing_dot, tmp_path, capsys):
    script = model_script(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert main(["render", str(script), "-o", str(out_dir / "model.svg")]) == 1
    assert "syntax error in line 1" in capsys.readouterr().err
    assert list(out_dir.iterdir()) == []


def test_failed_render_keeps_the_previous_drawing(failing_dot, tmp_path, capsys):
    script = model_script(tmp_path)
    out = tmp_path / "model.svg"
    good = b'<?xml version="1.0"?>\n<svg>an earlier, complete drawing</svg>\n'
    out.write_bytes(good)
    assert main(["render", str(script), "-o", str(out)]) == 1
    assert "syntax error in line 1" in capsys.readouterr().err
    assert out.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "model.svg", "until_model.py"]
