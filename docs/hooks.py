"""The documentation site's hook (mkdocs.yml ``hooks:``): pages that are generated or live elsewhere in the tree.

Nothing here is a copy. The command reference is rendered from the ``ggml-rpc`` parsers themselves and the check
catalogue from ``CATALOGUE``, at every build, so neither can drift from the code. The root documents (SECURITY.md,
INTEROP.md, BENCHMARKS.md, ARCHITECTURE.md, CHANGELOG.md) and the generated ones kept beside their sources
(spec/PROTOCOL.md, reference/OPS.md) become pages at their own path in the tree, read from where they are, so their
links to each other work on the site as they do in the repository. The raw run data under runs/ is served as is.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the renderers below need no mkdocs: the tests check them without it
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files

#: Documents kept outside docs/, shown as pages at their own path.
INCLUDED = ("spec/PROTOCOL.md", "SECURITY.md", "INTEROP.md", "BENCHMARKS.md", "ARCHITECTURE.md",
            "reference/OPS.md", "CHANGELOG.md")
#: Raw run data the records link to, served as files.
RUNS = "runs"

_WIDTH = 110


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _escape(text: str) -> str:
    """Markdown-safe help text: ``*``, ``_``, ``<`` and ``|`` literal outside code spans (kept as written inside)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside backticks
        parts[i] = re.sub(r"([*_\\|])", r"\\\1", parts[i]).replace("<", "&lt;")
    return "`".join(parts).replace("\n", " ")


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """A parser's sub-commands: name, parser, one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]
    return []


def _command(parser: argparse.ArgumentParser, summary: str, level: int) -> list[str]:
    """One command's section: its summary and description, usage, and every option with its help."""
    formatter = argparse.HelpFormatter(parser.prog, width=_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    out = [f"{'#' * level} {parser.prog}", ""]
    if summary:
        out += [_escape(summary[0].upper() + summary[1:]) + ".", ""]
    if parser.description:
        out += [_escape(parser.description), ""]
    out += ["```text", formatter.format_help().strip(), "```", ""]
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        names = formatter._format_action_invocation(action)
        rows.append(f"| `{names}` | {_escape(formatter._expand_help(action)) if action.help else ''} |")
    if rows:
        out += ["| option | what it does |", "|---|---|", *rows, ""]
    if parser.epilog:
        out += [_escape(parser.epilog), ""]
    return out


def commands_page() -> str:
    """The command reference: every ``ggml-rpc`` command and sub-command, as ``--help`` shows them."""
    from ggml_rpc.conformance.cli import COMMANDS, build_parser

    top = build_parser(COMMANDS)
    out = ["# Command reference", "",
           "Generated from the `ggml-rpc` parsers when the site is built: each section is what `ggml-rpc COMMAND "
           "--help` prints. The conventions every command shares (versions, `-` for standard output, exit codes, "
           "signals) are in [Getting started](getting-started.md#conventions).", "",
           *_command(top, "", 2)]
    for _name, parser, summary in _subcommands(top):
        out += _command(parser, summary, 2)
        for _sub_name, sub, sub_summary in _subcommands(parser):
            out += _command(sub, sub_summary, 3)
    return "\n".join(out)


def catalogue_page() -> str:
    from ggml_rpc.conformance.checks import CATALOGUE
    from ggml_rpc.conformance.checks.figures import page

    return page(CATALOGUE)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    from mkdocs.structure.files import File

    root = _root(config)
    files.append(File.generated(config, "commands.md", content=commands_page()))
    files.append(File.generated(config, "catalogue.md", content=catalogue_page()))
    for rel in INCLUDED:
        files.append(File.generated(config, rel, abs_src_path=str(root / rel)))
    for path in sorted((root / RUNS).rglob("*")):
        if path.is_file():
            files.append(File.generated(config, path.relative_to(root).as_posix(), abs_src_path=str(path)))
    return files
