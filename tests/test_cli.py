"""The command line's own options (``python -m vgraph --version``); ``render`` is tested in
test_render*.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
