"""Every example's command line: --help shows each option's default and help text, and has --progress."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(path: Path, monkeypatch) -> argparse.ArgumentParser:
    """The ArgumentParser an example's main() builds (caught when it parses)."""
    spec = importlib.util.spec_from_file_location(f"vgraph_example_cli_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)

    def capture(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed) as info:
        module.main([])
    return info.value.parser


def test_every_example_is_found():
    assert {p.stem for p in EXAMPLES} >= {"rnn_bptt", "lstm_sequence", "adaptive_loop", "routing_branch",
                                         "stacked_rnn", "untied_depth"}  # fmt: skip


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_help_shows_defaults_and_every_option_has_help(path, monkeypatch):
    parser = parser_of(path, monkeypatch)
    assert parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        assert action.help and action.help.strip(), f"{path.name}: {action.option_strings} has no help"
        assert "(default" not in action.help, (
            f"{path.name}: {action.option_strings} repeats its default by hand"
        )
    text = parser.format_help()
    for action in options:
        if action.default is not None:
            assert f"(default: {action.default})" in " ".join(text.split()), (path.name, action.dest)
    progress = next(a for a in options if a.dest == "progress")
    assert progress.choices == ("auto", "bar", "lines", "off") and progress.default == "auto"
