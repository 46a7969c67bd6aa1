"""Every `capsnet <subcommand> ...` in the docs and shell scripts still parses: a guard against doc drift.

Commands are taken from fenced code blocks and inline code spans of the Markdown docs and from the shell
scripts, split with shlex (never run) and checked against capsnet.cli.build_parser(): the subcommand
exists, every --long-flag is one that subcommand accepts, and a flag with a fixed set of values is given
one of them. Positional arguments and file paths are not checked.

The flag tables of `capsnet serve` (docs/serving.md) and `capsnet train` (docs/training.md) are checked too: each
flag exists, the serve table lists every flag, and a stated default is the code's.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from capsnet.cli import build_parser
from capsnet.models.config import PRESETS, ROUTING_VARIANTS

REPO = Path(__file__).resolve().parents[1]
DOC_GLOBS = ("README.md", "docs/*.md", "docs/benchmarks/*.md", "docs/experiments/README.md", "deploy/**/*.md")
SCRIPT_GLOBS = ("scripts/**/*.sh", "deploy/**/*.sh")

# Flags the parser takes as free text (a metavar only) and the code validates after parsing.
EXTRA_CHOICES = {"--preset": tuple(PRESETS), "--routing": ROUTING_VARIANTS}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`]+)`")  # may wrap onto the next line, as Markdown allows
ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=")
VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))\Z")  # a token that is one whole $NAME or ${NAME}
# "capsnet serve: ready: ..." is output and "capsnet 1" a model name, not commands: a subcommand is a bare word.
SUBCOMMAND = re.compile(r"[a-z][a-z-]*\Z")
COMMAND_ENDS = {"|", "||", "&&", ";", "&"}


@dataclass(frozen=True)
class Command:
    path: str  # relative to the repository
    line: int  # where the command starts
    subcommand: str
    args: tuple[str, ...]  # the tokens after the subcommand, $VARIABLEs expanded where known


def join_continuations(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line number, text) with `\\`-continued lines joined into the first one's line."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, text in lines:
        if pending is not None:
            number, text = pending[0], pending[1] + " " + text.lstrip()
        if text.rstrip().endswith("\\"):
            pending = (number, text.rstrip()[:-1])
        else:
            pending = None
            joined.append((number, text))
    if pending is not None:
        joined.append(pending)
    return joined


def tokens_of(text: str) -> list[str] | None:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote: prose or another language, not a shell command
        return None


def commands_in_snippet(path: str, lines: list[tuple[int, str]]) -> list[Command]:
    """The capsnet commands in one code block, inline span or script; VAR="..." set in it are expanded."""
    variables: dict[str, list[str]] = {}
    commands = []
    for number, text in join_continuations(lines):
        tokens = tokens_of(text)
        if not tokens:
            continue
        if ASSIGNMENT.match(text) and len(tokens) == 1:  # COMMON="--data ... --epochs 60" on its own line
            name, _, value = tokens[0].partition("=")
            variables[name] = tokens_of(value) or []
            continue
        tokens = expand(tokens, variables)
        for i, token in enumerate(tokens[:-1]):
            if token == "capsnet" and SUBCOMMAND.match(tokens[i + 1]):
                commands.append(Command(path, number, tokens[i + 1], tuple(arguments(tokens[i + 2:]))))
    return commands


def expand(tokens: list[str], variables: dict[str, list[str]]) -> list[str]:
    """$NAME replaced by its words where NAME was set in the snippet; others stay (and are skipped later)."""
    expanded = []
    for token in tokens:
        match = VARIABLE.match(token)
        name = match and (match.group(1) or match.group(2))
        expanded.extend(variables[name] if name in variables else [token])
    return expanded


def arguments(tokens: list[str]) -> list[str]:
    """A command's own tokens: up to a pipe, `;`, `&&` or `&`, and none after `--` (those go elsewhere)."""
    own = []
    depth = 0  # inside a usage synopsis's [...], where `|` separates alternatives instead of piping
    for token in tokens:
        if token == "--" or (token in COMMAND_ENDS and depth == 0):
            break
        depth += token.count("[") - token.count("]")
        if token != "|":
            own.append(token.strip("[]"))
    return own


def markdown_commands(path: Path, root: Path = REPO) -> list[Command]:
    relative = path.relative_to(root).as_posix()
    prose, commands = [], []
    block: list[tuple[int, str]] | None = None
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(text):
            if block is not None:
                commands += commands_in_snippet(relative, block)
            block = [] if block is None else None
            prose.append("")  # keep line numbers; a fence ends any inline span
        elif block is not None:
            block.append((number, text))
            prose.append("")
        else:
            prose.append(text)
    text = "\n".join(prose)
    for span in INLINE_CODE.finditer(text):
        if "\n\n" not in span.group(1):  # a stray backtick does not open a span across paragraphs
            number = text.count("\n", 0, span.start()) + 1
            commands += commands_in_snippet(relative, [(number, span.group(1).replace("\n", " "))])
    return commands


def script_commands(path: Path) -> list[Command]:
    lines = list(enumerate(path.read_text().splitlines(), start=1))
    return commands_in_snippet(path.relative_to(REPO).as_posix(), lines)


def files(globs: tuple[str, ...]) -> list[Path]:
    return sorted({path for pattern in globs for path in REPO.glob(pattern)})


def find_commands() -> list[Command]:
    return ([c for path in files(DOC_GLOBS) for c in markdown_commands(path)]
            + [c for path in files(SCRIPT_GLOBS) for c in script_commands(path)])


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    # argparse has no public way to list subcommands or a parser's flags; these attributes have been stable for years.
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def problems(command: Command, parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """What is wrong with one command, one line each; [] when it parses as far as these checks go."""
    where = f"{command.path}:{command.line}: capsnet {command.subcommand}"
    if command.subcommand not in parsers:
        return [f"{where}: no such subcommand (have: {', '.join(parsers)})"]
    options = parsers[command.subcommand]._option_string_actions
    found = []
    args = list(command.args)
    for i, token in enumerate(args):
        if not token.startswith("--") or token == "--":
            continue
        flag, has_value, value = token.partition("=")
        action = options.get(flag)  # exact: argparse would take a prefix, but a new flag can make it ambiguous
        if action is None:
            found.append(f"{where}: {flag} is not one of its flags")
            continue
        if action.nargs == 0:
            continue
        if not has_value:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
        allowed = action.choices or EXTRA_CHOICES.get(flag)
        # A usage synopsis offers alternatives (`--split test|validation`); $VARS and placeholders are unknown.
        for choice in value.split("|"):
            if allowed and choice and "$" not in choice and not choice.isupper() and choice not in allowed:
                found.append(f"{where}: {flag} {choice!r} is not one of {', '.join(allowed)}")
    return found


COMMANDS = find_commands()
BY_LINE: dict[tuple[str, int], list[Command]] = defaultdict(list)
for _command in COMMANDS:
    BY_LINE[(_command.path, _command.line)].append(_command)


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return subparsers(build_parser())


@pytest.mark.parametrize("where", sorted(BY_LINE), ids=lambda where: f"{where[0]}:{where[1]}")
def test_documented_command_parses(parsers, where):
    found = [p for command in BY_LINE[where] for p in problems(command, parsers)]
    assert not found, "\n".join(found)


def test_every_subcommand_is_documented(parsers):
    # Also proves the extraction works: README's pipeline table names every stage in inline code.
    readme = {c.subcommand for c in COMMANDS if c.path == "README.md"}
    assert set(parsers) - readme == set(), "README.md shows no example of these subcommands"
    documented = {c.subcommand for c in COMMANDS if c.path.endswith(".md")}
    assert set(parsers) <= documented


def test_the_check_catches_drift(parsers, tmp_path):
    """The extraction and the check themselves, on a made-up doc: what they must find and what they must flag."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run `capsnet eval m.ckpt --json` or `capsnet\nserve --model DIR`.\n"
        "```sh\n"
        'COMMON="--epochs 3 \\\n  --no-such-flag"\n'
        "capsnet train $COMMON --preset huge \\\n  --routing leaky -- --ignored\n"
        "capsnet frobnicate --x\n"
        "```\n"
        "`capsnet serve: ready: capsnet 1 on onnxruntime` is output, not a command\n"
    )
    commands = markdown_commands(doc, root=tmp_path)
    assert [(c.line, c.subcommand, c.args) for c in commands] == [
        (6, "train", ("--epochs", "3", "--no-such-flag", "--preset", "huge", "--routing", "leaky")),
        (8, "frobnicate", ("--x",)),
        (1, "eval", ("m.ckpt", "--json")),
        (1, "serve", ("--model", "DIR")),
    ]
    flagged = [p.split(": ", 2)[2] for c in commands for p in problems(c, parsers)]
    assert flagged == [
        "--no-such-flag is not one of its flags",
        "--preset 'huge' is not one of " + ", ".join(PRESETS),
        "no such subcommand (have: " + ", ".join(parsers) + ")",
    ]


# The flag tables: every flag a table names is one its command takes, a complete table names every flag, and a
# stated default is the code's. (doc, heading the table follows): (subcommand, whether it lists every flag).
FLAG_TABLES = {
    ("docs/serving.md", "## Settings"): ("serve", True),
    ("docs/training.md", "## Optimisation and execution flags"): ("train", False),
}
DEFAULT_WORD = re.compile(r"^[`(]*([^\s`(),;]*)")  # a default cell's first word: `127.0.0.1`, 0.001 (EM: ...), off


def flag_table(path: Path, heading: str) -> list[tuple[int, list[str], str]]:
    """(line, flags of the row's first cell, its default cell) for each row of the first table after `heading`."""
    lines = path.read_text().splitlines()
    start = lines.index(heading)
    rows, header = [], None
    for number, text in enumerate(lines[start + 1:], start=start + 2):
        if not text.startswith("|"):
            if header is not None:
                break
            continue
        cells = [cell.strip() for cell in text.strip().strip("|").split("|")]
        if header is None:
            header = [cell.lower() for cell in cells]
        elif not set(text) <= set("|-: "):  # the separator row
            flags = [word for span in INLINE_CODE.findall(cells[0]) for word in span.split() if word.startswith("--")]
            rows.append((number, flags, cells[header.index("default")]))
    return rows


def code_defaults(subcommand: str, parser: argparse.ArgumentParser) -> dict[str, object]:
    """Each flag's effective default, by dest: where argparse has None, the value the code then applies."""
    if subcommand == "serve":
        from capsnet.serving.config import ServerConfig
        return ServerConfig.defaults()
    from capsnet.training.resume import SETTINGS, ByArch
    applied = {name: setting.default.of("capsnet") if isinstance(setting.default, ByArch) else setting.default
               for name, setting in SETTINGS.items()}
    return {a.dest: a.default if a.default is not None else applied.get(a.dest) for a in parser._actions}


def default_problem(flag: str, stated: str, default: object) -> str | None:
    """Whether a table's default cell contradicts the code's default; prose ("from the model") for None is fine."""
    word = DEFAULT_WORD.match(stated).group(1)
    if default is None:
        return None
    if isinstance(default, bool):
        ok = not default and word in ("", "off")
    elif isinstance(default, (int, float)):
        try:
            ok = float(word) == float(default)
        except ValueError:
            ok = False
    else:
        ok = word == str(default)
    return None if ok else f"{flag}: the table says {stated!r}, the code's default is {default!r}"


def switch_default(action: argparse.Action, default: object) -> object:
    """A switch's row states whether the flag is on by default, not its setting's default: `--no-http` (which sets
    http=False) is off while http defaults to True."""
    if action.nargs == 0 and default is not None and isinstance(action.const, bool):
        return default == action.const
    return default


def flag_table_problems(path: Path, heading: str, subcommand: str, complete: bool,
                        parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    parser = parsers[subcommand]
    options = {flag: action for flag, action in parser._option_string_actions.items() if flag not in ("-h", "--help")}
    defaults = code_defaults(subcommand, parser)
    found, listed = [], set()
    for line, flags, stated in flag_table(path, heading):
        for flag in flags:
            listed.add(flag)
            if flag not in options:
                found.append(f"{path.name}:{line}: {flag} is not a flag of capsnet {subcommand}")
            elif len(flags) == 1:
                problem = default_problem(flag, stated, switch_default(options[flag], defaults.get(options[flag].dest)))
                found += [f"{path.name}:{line}: {problem}"] if problem else []
    if complete:
        missing = sorted(set(options) - listed)
        found += [f"{path.name} {heading!r}: capsnet {subcommand} {flag} is missing" for flag in missing]
    return found


@pytest.mark.parametrize("where", sorted(FLAG_TABLES), ids=lambda where: f"{where[0]} {where[1]}")
def test_flag_table_matches_the_parser(parsers, where):
    subcommand, complete = FLAG_TABLES[where]
    found = flag_table_problems(REPO / where[0], where[1], subcommand, complete, parsers)
    assert not found, "\n".join(found)


def test_the_flag_table_check_catches_drift(parsers, tmp_path):
    doc = tmp_path / "doc.md"
    rows = [f"| `{flag}` | | {value} | |" for flag, value in (
        ("--model DIR", "(required)"), ("--host", "`0.0.0.0`"), ("--grpc-port", "8001"), ("--threads", "2"),
        ("--max-message-bytes", "from the model"), ("--no-such-flag", "1"), ("--no-http", "on"))]
    doc.write_text("## Settings\n\n| flag | env | default | meaning |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    found = flag_table_problems(doc, "## Settings", "serve", True, parsers)
    assert found[:4] == [
        "doc.md:6: --host: the table says '`0.0.0.0`', the code's default is '127.0.0.1'",
        "doc.md:8: --threads: the table says '2', the code's default is 0",
        "doc.md:10: --no-such-flag is not a flag of capsnet serve",
        # a switch that turns a default-on setting off is itself off by default
        "doc.md:11: --no-http: the table says 'on', the code's default is False",
    ]
    assert "doc.md '## Settings': capsnet serve --gpu is missing" in found[4:]
    assert not any("--grpc-port" in p or "--model " in p or "--max-message-bytes:" in p for p in found)
