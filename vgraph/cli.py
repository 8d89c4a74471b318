"""The ``vgraph`` command line: ``python -m vgraph render SCRIPT -o out.svg``.

A *model script* is a Python file defining ``build()``, which returns
``(virtual_graph, feed, outputs)``: the :class:`~vgraph.virtual.VirtualGraph`, a feed dict for
one build, and the output node(s) to build; with ``--gradients`` the first output is the loss
(a scalar). See ``examples/models/`` and ``docs/rendering.md``.

Exit codes: 0 success; 1 the model or the drawing failed (an exception in the script, Graphviz
missing — the ``.dot`` text is then written next to the output —, ``dot`` failing); 2 bad
arguments, or a script that is missing or does not follow the convention.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _UsageError(Exception):
    """A problem with the command line or the script's convention (exit code 2)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vgraph",
        description="vgraph command line tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    r = sub.add_parser(
        "render",
        help="draw a model script's graph with Graphviz",
        description=(
            "Draw the model of SCRIPT (a Python file whose build() returns "
            "(virtual_graph, feed, outputs)): the virtual graph by default, the unrolled compute "
            "graph of one build with --unrolled, and gradient norms after backward with --gradients."
        ),
    )
    r.add_argument(
        "script", metavar="SCRIPT", help="model script defining build() -> (virtual_graph, feed, outputs)"
    )
    r.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="output file; the format comes from the suffix (.svg, .png, .pdf, .dot)")  # fmt: skip
    r.add_argument("--format", help="output format, overriding the suffix (svg, png, pdf, dot …)")
    r.add_argument("--unrolled", action="store_true",
                   help="draw the unrolled compute graph of one build (implied by --fold, --all, --iterations)")  # fmt: skip
    folding = r.add_mutually_exclusive_group()
    folding.add_argument("--fold", nargs=2, type=int, metavar=("FIRST", "LAST"),
                         help="show the first FIRST and last LAST iterations of long loops (default 3 3)")  # fmt: skip
    folding.add_argument("--all", action="store_true", help="show every iteration (no folding)")
    folding.add_argument("--iterations", nargs=2, type=int, metavar=("START", "STOP"),
                         help="show only iterations START <= t < STOP of each loop")  # fmt: skip
    r.add_argument("--gradients", action="store_true",
                   help="run backward from the first output (the loss) and colour nodes by gradient norm "
                        "(implies --unrolled)")  # fmt: skip
    r.add_argument("--taken", action="store_true",
                   help="virtual view: build once and grey out what the build did not use")  # fmt: skip
    r.add_argument(
        "--guards", action="store_true", help="also draw structural guard nodes (LoopCheck, LengthCheck)"
    )
    r.add_argument("--no-constants", action="store_true", help="leave constant nodes out")
    r.add_argument("--lr", action="store_true", help="lay out left to right instead of top to bottom")
    r.add_argument("--title", help="title drawn above the graph")
    return parser


def _load_script(path_text: str) -> Any:
    path = Path(path_text)
    if not path.is_file():
        raise _UsageError(f"model script {path_text!r} not found")
    name = "_vgraph_model_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _UsageError(f"cannot load {path_text!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.resolve().parent))  # let the script import its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    if not callable(getattr(module, "build", None)):
        raise _UsageError(
            f"{path_text} defines no build() function; a model script must define "
            "build() -> (virtual_graph, feed, outputs)"
        )
    return module


def _call_build(module: Any, script: str) -> tuple[Any, dict[str, Any], list[Any]]:
    from .virtual import VirtualGraph, VirtualNode

    result = module.build()
    if not (isinstance(result, tuple) and len(result) == 3):
        raise _UsageError(
            f"{script}: build() must return (virtual_graph, feed, outputs), got {type(result).__name__}"
            + (f" of length {len(result)}" if isinstance(result, tuple) else "")
        )
    g, feed, outputs = result
    if not isinstance(g, VirtualGraph):
        raise _UsageError(f"{script}: build()[0] must be a VirtualGraph, got {type(g).__name__}")
    if not isinstance(feed, dict):
        raise _UsageError(
            f"{script}: build()[1] must be a feed dict (input name -> array), got {type(feed).__name__}"
        )
    outs = [outputs] if isinstance(outputs, VirtualNode) else list(outputs)
    if not outs or not all(isinstance(o, VirtualNode) for o in outs):
        raise _UsageError(f"{script}: build()[2] must be an output node or a non-empty list of them")
    return g, feed, outs


def _render(args: argparse.Namespace) -> int:
    from . import render as R
    from .errors import RenderError, VGraphError

    module = _load_script(args.script)
    g, feed, outputs = _call_build(module, args.script)
    options: dict[str, Any] = {"guards": args.guards, "constants": not args.no_constants,
                               "rankdir": "LR" if args.lr else "TB", "title": args.title}  # fmt: skip
    fmt = (args.format or Path(args.output).suffix.lstrip(".")).lower()
    if not fmt:
        raise _UsageError(
            f"cannot tell the output format of {args.output!r}: give it a suffix (.svg, .png, .pdf, .dot) or --format"
        )
    if fmt not in R.FORMATS:
        raise _UsageError(f"unknown output format {fmt!r}; use one of {', '.join(R.FORMATS)}")
    # Folding options only make sense for the unrolled graph, so they imply it.
    unrolled = args.unrolled or args.gradients or args.all or bool(args.fold) or bool(args.iterations)
    if unrolled:
        if args.all:
            options["fold"] = None
        elif args.fold:
            if min(args.fold) < 0:
                raise _UsageError("--fold takes two non-negative numbers")
            options["fold"] = tuple(args.fold)
        if args.iterations:
            options["iterations"] = range(*args.iterations)
        cg = g.build(feed, outputs)
        if args.gradients:
            loss = cg.outputs[0]
            if loss.value.size != 1:
                raise _UsageError(
                    f"--gradients needs the first output to be a scalar loss; {loss.describe()} has shape {loss.shape}"
                )
            R.retain_all_grads(cg)
            cg.backward(loss)
            options["gradients"] = True
        target: Any = cg
    else:
        if args.taken:
            options["build"] = g.build(feed, outputs)
        target = g
    try:
        out = R.render(target, args.output, format=args.format, **options)
    except RenderError as e:
        print(f"vgraph render: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except VGraphError as e:
        print(f"vgraph render: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote {out}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed the message
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    try:
        if args.command == "render":
            return _render(args)
    except _UsageError as e:
        print(f"vgraph {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = next(
            (
                f"{Path(f.filename).name}:{f.lineno}"
                for f in reversed(tb)
                if f.filename == str(Path(args.script).resolve()) or f.filename == args.script
            ),
            None,
        )
        print(
            f"vgraph {args.command}: error: {type(e).__name__}: {e}" + (f" (at {where})" if where else ""),
            file=sys.stderr,
        )
        return EXIT_FAILED
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse rejects it first
    return EXIT_USAGE
