"""Drawing with Graphviz's ``dot`` program: :func:`render` (a file), :func:`to_svg`, and the
rich display of ComputeGraph and VirtualGraph in Jupyter."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .._files import write_atomically
from ..compute import ComputeGraph
from ..errors import RenderError
from ..virtual import VirtualGraph
from .views import _scene, to_dot

#: Output formats :func:`render` accepts (``dot``/``gv`` write the DOT text and need no Graphviz).
FORMATS = ("svg", "png", "pdf", "jpg", "jpeg", "gif", "ps", "eps", "json", "dot", "gv")
#: Jupyter display is skipped (text only) for drawings with more nodes than this.
REPR_MAX_NODES = 1500

_INSTALL_HINT = (
    "Install Graphviz: Debian/Ubuntu `sudo apt-get install graphviz`, macOS `brew install graphviz`, "
    "conda `conda install -c conda-forge graphviz`, Windows https://graphviz.org/download/ "
    "(the `dot` program must be on PATH)."
)


def dot_available() -> bool:
    """Whether Graphviz's ``dot`` program is on ``PATH``."""
    return shutil.which("dot") is not None


def _dot_program() -> str:
    exe = shutil.which("dot")
    if exe is None:
        raise RenderError("Graphviz's `dot` program was not found on PATH. " + _INSTALL_HINT)
    return exe


def _run_dot(dot_text: str, fmt: str) -> bytes:
    """Run ``dot -T{fmt}`` on ``dot_text`` and return what it printed."""
    args = [_dot_program(), f"-T{fmt}"]
    try:
        proc = subprocess.run(
            args, check=False, input=dot_text.encode("utf-8"), capture_output=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        raise RenderError(
            f"`dot -T{fmt}` did not finish within 300 s; draw fewer iterations (fold=)"
        ) from None
    if proc.returncode != 0:
        raise RenderError(
            f"`dot -T{fmt}` failed (exit code {proc.returncode}): {proc.stderr.decode(errors='replace').strip()}"
        )
    return proc.stdout


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (see :func:`vgraph._files.write_atomically`):
    a failure never leaves a partial file, nor harms a file already at ``path``.

    Raises:
        RenderError: the file cannot be written (names it and the reason).
    """
    try:
        write_atomically(str(path), lambda f: f.write(data), "drawing")
    except OSError as e:
        raise RenderError(f"cannot write {str(path)!r}: {e.strerror or e}") from e


def render(
    graph: VirtualGraph | ComputeGraph,
    path: str | os.PathLike[str],
    format: str | None = None,
    **options: Any,
) -> Path:
    """Draw ``graph`` into the file ``path`` with Graphviz's ``dot`` program.

    Args:
        graph: what to draw (see :func:`to_dot`).
        path: the output file.
        format: ``svg``, ``png``, ``pdf`` … (default: from ``path``'s suffix). ``dot`` (or a
            ``.dot``/``.gv`` file) writes the DOT text and needs no Graphviz.
        **options: the options of :func:`to_dot` (``fold``, ``gradients`` …).

    The file is written whole or not at all: when drawing fails, nothing is left at ``path``
    and a file already there is kept as it was.

    Returns:
        The path written.

    Raises:
        RenderError: ``dot`` is not installed (the DOT text is then written next to ``path``, as
            ``path`` with suffix ``.dot``, so it can be rendered elsewhere), ``dot`` failed, the
            format is unknown, or the file cannot be written (e.g. its folder does not exist).
        TypeError: ``path`` or ``format`` of the wrong type (and the errors of :func:`to_dot`).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    if format is not None and not isinstance(format, str):
        raise TypeError(f"format must be a string such as 'svg' or None, got {type(format).__name__}")
    path = Path(path)
    fmt = (format or path.suffix.lstrip(".")).lower()
    if not fmt:
        raise RenderError(
            f"cannot tell the output format of {str(path)!r}: give it a suffix (.svg, .png, .pdf) or format="
        )
    if fmt not in FORMATS:
        raise RenderError(f"unknown output format {fmt!r}; use one of {', '.join(FORMATS)}")
    text = to_dot(graph, **options)
    if fmt in ("dot", "gv"):
        _write_whole(path, text.encode("utf-8"))
        return path
    if shutil.which("dot") is None:
        dot_path = path.with_suffix(".dot")
        _write_whole(dot_path, text.encode("utf-8"))
        raise RenderError(
            f"cannot draw {str(path)!r}: Graphviz's `dot` program was not found on PATH. {_INSTALL_HINT} "
            f"The DOT text was written to {str(dot_path)!r}; draw it later with "
            f"`dot -T{fmt} {dot_path.name} -o {path.name}`."
        )
    _write_whole(path, _run_dot(text, fmt))
    return path


def to_svg(graph: VirtualGraph | ComputeGraph, **options: Any) -> str:
    """The drawing as SVG text (runs ``dot``; raises :class:`RenderError` if it is missing)."""
    return _run_dot(to_dot(graph, **options), "svg").decode("utf-8")


# ============================================================================ Jupyter display


def _display_svg(graph: Any) -> tuple[str | None, str]:
    """The SVG Jupyter shows for ``graph`` (default options), or None and the reason why not.

    Never raises (display must not): any failure becomes the reason.
    """
    try:
        scene = _scene(graph)
        if len(scene.nodes) > REPR_MAX_NODES:
            return None, (
                f"the drawing has {len(scene.nodes)} nodes, more than render.REPR_MAX_NODES "
                f"({REPR_MAX_NODES}); draw it with vgraph.render.render(graph, 'out.svg', fold=...)"
            )
        if not dot_available():
            return None, "Graphviz's `dot` program was not found on PATH. " + _INSTALL_HINT
        return _run_dot(scene.source(), "svg").decode("utf-8"), ""
    except Exception as e:  # display must never raise: fall back to text saying why
        return None, f"drawing failed: {type(e).__name__}: {e}"


def _safe_repr(obj: Any) -> str:
    try:
        return repr(obj)
    except Exception as e:
        return f"<{type(obj).__name__} (repr failed: {type(e).__name__}: {e})>"


def _repr_svg_(self: Any) -> str | None:
    """SVG for Jupyter; ``None`` (plain text shown) if ``dot`` is missing, the drawing is huge
    or drawing fails. Never raises."""
    return _display_svg(self)[0]


def _repr_mimebundle_(self: Any, include: Any = None, exclude: Any = None) -> dict[str, str]:
    """Jupyter's rich display: the drawing as SVG (default options) plus the plain repr; when
    there is no drawing, the plain repr says why. Never raises."""
    svg, reason = _display_svg(self)
    if svg is None:
        return {"text/plain": f"{_safe_repr(self)}\n(no drawing: {reason})"}
    return {"text/plain": _safe_repr(self), "image/svg+xml": svg}


# Added here, not in the classes: drawing depends on compute and virtual, not the other way round.
for _cls in (ComputeGraph, VirtualGraph):
    for _name, _method in (("_repr_svg_", _repr_svg_), ("_repr_mimebundle_", _repr_mimebundle_)):
        setattr(_cls, _name, _method)
del _cls, _name, _method
