"""The ``vgraph`` command line: ``python -m vgraph render SCRIPT -o out.svg``.

A *model script* is a Python file defining ``build()``, which returns
``(virtual_graph, feed, outputs)``: the :class:`~vgraph.virtual.VirtualGraph`, a feed dict for
one build, and the output node(s) to build; with ``--gradients`` the first output is the loss
(a scalar). ``--set KEY=VALUE`` passes keyword arguments to ``build()`` (``--set steps=50``). See
``examples/models/`` and ``docs/rendering.md``.

Exit codes: 0 success; 1 the model or the drawing failed (an exception in the script, Graphviz
missing — the ``.dot`` text is then written next to the output —, ``dot`` failing; the output
file is then neither written nor, if it exists, changed); 2 bad arguments, or a script that is
missing or does not follow the convention.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _UsageError(Exception):
    """A problem with the command line or the script's convention (exit code 2)."""


def _version() -> str:
    from . import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vgraph",
        description="vgraph command line tools.",
    )
    parser.add_argument("--version", action="version", version=f"vgraph {_version()}",
                        help="print vgraph's version and exit")  # fmt: skip
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
    r.add_argument("-o", "--output", metavar="FILE",
                   help="output file; the format comes from the suffix (.svg, .png, .pdf, .dot)")  # fmt: skip
    r.add_argument("--html", metavar="FILE",
                   help="also (or only) write the interactive explorer page of the model and one build, "
                        "with gradients (see docs/explorer.md)")  # fmt: skip
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
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                   help="pass KEY=VALUE to the script's build() as a keyword argument (repeatable), "
                        "e.g. --set steps=50; VALUE is a Python literal (50, 0.5, 'tanh', (2, 3)) or else "
                        "a string")  # fmt: skip
    return parser


def _parse_settings(settings: Sequence[str]) -> dict[str, Any]:
    """``["steps=50", "name=x"]`` -> ``{"steps": 50, "name": "x"}`` (values as Python literals)."""
    out: dict[str, Any] = {}
    for item in settings:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise _UsageError(
                f"--set takes KEY=VALUE with KEY a Python name, e.g. --set steps=50; got {item!r}"
            )
        if key in out:
            raise _UsageError(f"--set {key}=... given twice")
        try:
            out[key] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            out[key] = text
    return out


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


def _call_build(
    module: Any, script: str, settings: dict[str, Any] | None = None
) -> tuple[Any, dict[str, Any], list[Any]]:
    from .virtual import VirtualGraph, VirtualNode

    settings = settings or {}
    if settings:
        try:
            params = inspect.signature(module.build).parameters
        except (TypeError, ValueError):  # a builtin or C callable: let the call decide
            params = None
        if params is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            accepted = [
                name for name, p in params.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            ]  # fmt: skip
            unknown = [k for k in settings if k not in accepted]
            if unknown:
                raise _UsageError(
                    f"{script}: build() takes no parameter {', '.join(map(repr, unknown))} (given with --set); "
                    f"it takes: {', '.join(accepted) or 'none'}"
                )
    result = module.build(**settings)
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

    settings = _parse_settings(args.settings)
    if args.iterations and not 0 <= args.iterations[0] < args.iterations[1]:
        start, stop = args.iterations
        raise _UsageError(
            f"--iterations {start} {stop} selects no iteration: it shows START <= t < STOP, so give "
            "0 <= START < STOP (e.g. --iterations 2 5)"
        )
    unrolled = args.unrolled or args.gradients or args.all or bool(args.fold) or bool(args.iterations)
    if args.taken and unrolled:
        implied = next(
            flag for flag, on in (("--unrolled", args.unrolled), ("--gradients", args.gradients),
                                  ("--all", args.all), ("--fold", args.fold), ("--iterations", args.iterations))
            if on
        )  # fmt: skip
        raise _UsageError(
            f"--taken applies to the virtual view (it greys out what one build did not use); {implied} draws "
            "the unrolled view, which shows only what the build used: drop one of them"
        )
    if args.output is None and args.html is None:
        raise _UsageError("give -o FILE (a drawing), --html FILE (the explorer page), or both")
    module = _load_script(args.script)
    g, feed, outputs = _call_build(module, args.script, settings)
    if args.html is not None:
        R.explore_script_result(g, feed, outputs, args.html)
        print(f"wrote {args.html}")
        if args.output is None:
            return EXIT_OK
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
    except (ValueError, TypeError) as e:  # drawing options this graph cannot take
        raise _UsageError(str(e)) from None
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
