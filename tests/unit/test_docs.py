"""The docs stay true: README.md, CONTRIBUTING.md and docs/*.md, whatever files exist.

- every relative link reaches a file, and its #anchor a heading of that file (GitHub's anchors);
- every dotted config key named in backticks (`group.key`, whose group is one of the run config's), or in a
  ```yaml block that is a run config, is a key of `lit-dist fit`'s run config, through init_args where a
  class_path chooses the class; run events and facts (`run.hung`), files (`model.pt`) and modules of lit_dist
  (`data.dataset.centre_crop`) are not keys;
- every `lit-dist ...` command line in a shell code block (or a code span) names a command and only options
  it takes, dotted overrides being config keys as above;
- the exit-code table lists every code lit-dist exits with, and no other.

The parsers are the real ones, built in this process without parsing anything (jsonargparse's
``capture_parser``); no command runs. Each check reports every problem at once, as ``file:line: what``.

    .venv/bin/python -m pytest -q tests/unit/test_docs.py
"""

import ast
import bisect
import collections.abc
import difflib
import importlib
import inspect
import re
import shlex
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock
from urllib.parse import unquote

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "lit_dist"

SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "shell-session", "zsh"}
YAML_BLOCKS = {"yaml", "yml"}
# Commands that run lit-dist as one of their arguments: `srun lit-dist fit`, `python -m lit_dist fit`.
LAUNCHERS = {"srun", "salloc", "torchrun", "mpirun", "deepspeed", "uv", "env"}
# A backticked `model.pt` names a file, not the key `pt` of the model group (checked only when it is no key).
FILE_SUFFIXES = {"pt", "pth", "pkl", "ckpt", "safetensors", "json", "yaml", "yml", "py", "parquet", "arrow",
                 "distcp", "png", "jpg", "jpeg", "txt", "log", "md", "sbatch", "sh"}
IDENT = r"[A-Za-z_]\w*"
KEY = rf"{IDENT}(?:\.{IDENT})+"
KEY_TOKEN = re.compile(rf"--(?P<flag>{KEY})(?:[ =].*)?|(?P<key>{KEY})(?:\s*[:=]\s*.*)?", re.S)
NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d*)?([eE][-+]?\d+)?")


def doc_files(root: Path = REPO) -> list[Path]:
    """The docs as they are now: README.md, CONTRIBUTING.md (once it exists) and every docs/*.md."""
    return [p for p in (root / "README.md", root / "CONTRIBUTING.md") if p.is_file()] + sorted(root.glob("docs/*.md"))


# ------------------------------------------------------------------------------------------------------------
# Reading markdown: fenced blocks, prose, code spans, headings
# ------------------------------------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)


@dataclass
class Block:
    """A fenced code block: its language (the info string's first word) and its lines, numbered from 1."""

    lang: str
    lines: list[tuple[int, str]]


@dataclass
class Doc:
    path: Path
    rel: str
    blocks: list[Block] = field(default_factory=list)
    prose: str = ""  # the text with every fenced block's lines blanked: offsets map to the file's lines
    spans: list[tuple[int, str]] = field(default_factory=list)  # code spans in prose: (offset, content)
    masked: str = ""  # prose with code spans and HTML comments blanked: what links are looked for in
    _starts: list[int] = field(default_factory=list)

    def line_at(self, offset: int) -> int:
        return bisect.bisect_right(self._starts, offset)


def read_doc(path: Path, root: Path) -> Doc:
    """A markdown file split as GitHub renders it: fenced blocks apart, code spans found and masked."""
    lines = path.read_text(encoding="utf-8").split("\n")
    doc = Doc(path, path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path))
    prose, block, fence = [], None, ""
    for number, line in enumerate(lines, 1):
        if block is None and (m := FENCE.match(line)):
            fence, block = m["fence"], Block(m["info"].lower(), [])
            prose.append("")
        elif block is not None:
            closing = line.strip()
            if closing.startswith(fence) and set(closing) == {fence[0]}:
                doc.blocks.append(block)
                block = None
            else:
                block.lines.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    if block is not None:  # an unclosed fence runs to the end of the file, as GitHub renders it
        doc.blocks.append(block)
    doc.prose = "\n".join(prose)
    doc._starts = [0] + [i + 1 for i, c in enumerate(doc.prose) if c == "\n"]
    masked = HTML_COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), doc.prose)
    for m in CODE_SPAN.finditer(masked):
        if not re.search(r"\n[ \t]*\n", m[0]):  # a code span never crosses a blank line
            doc.spans.append((m.start(), m[2]))
    doc.masked = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), masked)
    return doc


HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text, lowercased, punctuation but `-` and `_` removed, each
    space a `-` (github-slugger)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Doc) -> set[str]:
    """Every anchor GitHub makes for a file: its headings' slugs (a repeat gets -1, -2, ...) and <a name/id>."""
    found, seen = set(), {}
    lines = doc.prose.split("\n")
    for i, line in enumerate(lines):
        text = None
        if m := HEADING.match(line):
            text = m[2]
        elif i and re.fullmatch(r" {0,3}(=+|-+)[ \t]*", line) and lines[i - 1].strip() \
                and not re.match(r"\s*([-*+>|#]|\d+[.)])", lines[i - 1]):
            text = lines[i - 1]  # a setext heading: the line above, underlined
        if text is not None:
            base = slug(text)
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    found.update(HTML_ANCHOR.findall(doc.masked))
    return found


# ------------------------------------------------------------------------------------------------------------
# 1. Links
# ------------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(?P<target><[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
                  r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(?P<target><[^>\n]*>|\S+)", re.M)
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def link_problems(files: Iterable[Path], root: Path = REPO) -> list[str]:
    """Every relative link of ``files`` whose file or #anchor does not exist."""
    cache: dict[Path, Doc] = {}

    def doc_of(path: Path) -> Doc:
        if path not in cache:
            cache[path] = read_doc(path, root)
        return cache[path]

    problems = []
    for path in files:
        doc = doc_of(path.resolve())
        found = [*LINK.finditer(doc.masked), *REFERENCE.finditer(doc.masked)]
        for m in sorted(found, key=lambda m: m.start()):
            target = m["target"].strip("<>")
            if not target or SCHEME.match(target):
                continue  # http(s), mailto and any other scheme: not a file of the repository
            where = f"{doc.rel}:{doc.line_at(m.start())}: link to {target}"
            file_part, _, anchor = target.partition("#")
            file_part = unquote(file_part)
            if not file_part:
                linked = doc.path
            elif file_part.startswith("/"):
                linked = (root / file_part.lstrip("/")).resolve()  # GitHub: from the repository's root
            else:
                linked = (doc.path.parent / file_part).resolve()
            if not linked.exists():
                shown = linked.relative_to(root).as_posix() if linked.is_relative_to(root) else str(linked)
                problems.append(f"{where}: there is no {shown}")
            elif anchor and linked.suffix.lower() == ".md" and linked.is_file():
                target_doc = doc_of(linked)
                if unquote(anchor) not in anchors(target_doc):
                    close = difflib.get_close_matches(unquote(anchor), sorted(anchors(target_doc)), n=1)
                    hint = f" (did you mean #{close[0]}?)" if close else ""
                    problems.append(f'{where} has no heading "{anchor}" in {target_doc.rel}{hint}')
    return problems


# ------------------------------------------------------------------------------------------------------------
# The run config's schema and the commands' parsers, built in this process
# ------------------------------------------------------------------------------------------------------------

OK = None
FREE = "free"  # beneath a dict or Any: any key


def _classes(hint) -> tuple[list[type], bool]:
    """(the classes a value of ``hint`` may be given as, by class_path; whether any key goes: a dict or Any)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or _is_mapping(origin) or _is_mapping(hint):
        return [], True
    if origin is collections.abc.Callable:  # OptimizerCallable: a class_path whose class the callable returns
        return _classes(args[-1]) if args else ([], False)
    if origin in (typing.Union, types.UnionType) or (inspect.isclass(origin) and issubclass(origin, Iterable)):
        classes, free = [], False
        for arg in args:
            more, any_key = _classes(arg)
            classes += [c for c in more if c not in classes]
            free |= any_key
        return classes, free
    if not inspect.isclass(hint) or hint in (str, bytes, int, float, bool, complex, type(None), Path):
        return [], False  # a value: a Literal, a scalar, a path
    return [hint], False


def _is_mapping(hint) -> bool:
    return inspect.isclass(hint) and issubclass(hint, Mapping)


def _import(path: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None


def _default_class(default):
    """The class a subclass option takes when no class_path is given: its default's."""
    if inspect.isclass(default):
        return default
    class_path = default.get("class_path") if isinstance(default, dict) else getattr(default, "class_path", None)
    return _import(class_path) if isinstance(class_path, str) else None


class Schema:
    """The options of `lit-dist fit` and of every command, from the real parsers (built once, nothing parsed)."""

    def __init__(self):
        from jsonargparse import ActionSubCommands, auto_parser, capture_parser

        from lit_dist.cli import app as cli
        from lit_dist.cli.commands import COMMANDS, LIGHTNING

        with mock.patch.object(sys, "argv", ["lit-dist"]):  # LightningCLI warns about pytest's own argv
            self.root = capture_parser(lambda: cli.LitDistCLI(args=[]))
            self.run_config = capture_parser(lambda: cli.RunConfigCLI(args=[], run=False))
        subcommands = next(a for a in self.root._actions if isinstance(a, ActionSubCommands))
        self.lightning = set(LIGHTNING)
        self.parsers = {name: subcommands.choices[name] for name in LIGHTNING}  # name: (parser of the run config)
        self.options = {name: self._option_strings(p) for name, p in self.parsers.items()}
        for name, command in COMMANDS.items():
            function = command.function()
            if command.run_config:  # its own flags (cli._own_flags takes them out first), then the run config's
                self.parsers[name] = self.run_config
                own = self._option_strings(cli._own_parser(function))
                self.options[name] = self._option_strings(self.run_config) | own
            else:
                self.options[name] = self._option_strings(auto_parser(function, exit_on_error=False))
        self.fit = self.parsers["fit"]
        dests = [a.dest for a in self.fit._actions]
        self.top_level = {d.split(".")[0] for d in dests} - {"help", "config", "print_config"}
        # Groups: the top-level names with keys beneath them (model and data are classes chosen by class_path).
        self.groups = {d.split(".")[0] for d in dests if "." in d} | {
            a.dest for a in self.fit._actions if "." not in a.dest and _classes(getattr(a, "_typehint", None))[0]}
        self._class_parsers: dict[type, object] = {}

    @staticmethod
    def _option_strings(parser) -> set[str]:
        return {o for a in parser._actions for o in a.option_strings}

    def _class_parser(self, cls: type):
        if cls not in self._class_parsers:
            from jsonargparse import ArgumentParser

            parser = ArgumentParser(exit_on_error=False, add_help=False)
            parser.add_class_arguments(cls, fail_untyped=False)
            self._class_parsers[cls] = parser
        return self._class_parsers[cls]

    def key_problem(self, key: str, class_paths: Mapping[str, str] | None = None, parser=None) -> str | None:
        """None if `--key` is an option of the run config (``parser``, default fit's), else what is wrong.

        ``class_paths``: the class_path given for a key in the same YAML block (``{"model.net": "..."}``). Keys
        beneath a class resolve through its init_args, as jsonargparse does: the given class, else the option's
        default class, else its one concrete class.
        """
        segments = key.split(".")
        if any(s in ("", "help") for s in segments[:-1]):
            return f"`{key}` is not a key"
        found = self._resolve(parser or self.fit, segments, 0, class_paths or {})
        return found if found is not OK and found != FREE else None

    def _resolve(self, parser, segments: list[str], done: int, class_paths) -> str | None:
        by_dest = {a.dest: a for a in parser._actions}
        key = ".".join(segments)
        for i in range(len(segments) - done, 0, -1):
            dest = ".".join(segments[done:done + i])
            if dest in by_dest:
                action, rest = by_dest[dest], segments[done + i:]
                break
        else:
            return self._unknown(key, by_dest, segments[:done])
        if not rest:
            return OK
        owner = ".".join(segments[:len(segments) - len(rest)])
        if not hasattr(action, "_typehint"):  # a group (`checkpoint`, `data.cache`): its keys are its own options
            return self._unknown(key, by_dest, segments[:done])
        classes, free = _classes(action._typehint)
        if free and not classes:
            return FREE
        if not classes:
            return f"`{key}` is not a key of the run config: `{owner}` is a value, with no keys beneath it"
        if rest == ["class_path"] or rest[0] == "dict_kwargs":
            return OK
        if rest[0] == "init_args":
            rest = rest[1:]
            if not rest:
                return OK
        given = class_paths.get(owner)
        cls = _import(given) if given else _default_class(action.default)
        if cls is None and given:
            return (f"`{owner}`'s class_path {given} cannot be imported" if given.startswith("lit_dist.") else OK)
        if cls is None:
            concrete = [c for c in classes if not inspect.isabstract(c)]
            if len(concrete) != 1:
                return OK  # the class is chosen at run time by class_path: what lies beneath it is unknown here
            cls = concrete[0]
        init = inspect.signature(cls.__init__) if inspect.isclass(cls) else inspect.signature(cls)
        if any(p.kind is p.VAR_KEYWORD for p in init.parameters.values()) and rest[0] not in init.parameters:
            return OK  # **kwargs: any name may be passed on
        prefix = [*segments[:len(segments) - len(rest)]]
        return self._resolve(self._class_parser(cls), prefix + rest, len(prefix), class_paths)

    @staticmethod
    def _unknown(key: str, by_dest: Mapping, prefix: list[str]) -> str:
        known = sorted(".".join([*prefix, d]) for d in by_dest if d.rsplit(".", 1)[-1] not in ("help", "config"))
        close = difflib.get_close_matches(key, known, n=1)
        return f"`{key}` is not a key of the run config" + (f" (did you mean `{close[0]}`?)" if close else "")

    def command_problems(self, argv: list[str]) -> list[str]:
        """What is wrong with `lit-dist ARGV`: its command, and each option that command does not take."""
        from lit_dist.cli.commands import NAMES

        if argv[:1] and argv[0].startswith("-"):  # options of LightningCLI's own parser, then its command
            at = next((i for i, a in enumerate(argv) if a in self.lightning), len(argv))
            before = self._option_problems("lit-dist", argv[:at], self._option_strings(self.root), None)
            return before + (self.command_problems(argv[at:]) if at < len(argv) else [])
        if not argv:
            return []
        name, rest = argv[0], argv[1:]
        if re.fullmatch(r"[A-Z][A-Z_]*", name):
            return []  # a placeholder, `lit-dist COMMAND --help`
        if name not in NAMES:
            return [f"lit-dist has no command `{name}` (its commands: {', '.join(NAMES)})"]
        return self._option_problems(f"lit-dist {name}", rest, self.options[name], self.parsers.get(name))

    def _option_problems(self, prog: str, args: list[str], options: set[str], parser) -> list[str]:
        problems, class_paths = [], {}
        for i, arg in enumerate(args):
            if not arg.startswith("-") or arg in ("-", "--") or NEGATIVE_NUMBER.fullmatch(arg):
                continue  # a value or a positional argument: values are not checked
            name, _, value = arg.partition("=")
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            if re.fullmatch(rf"{KEY}", value) and value.rsplit(".", 1)[1][:1].isupper():
                class_paths[name[2:]] = value  # `--model.net lit_dist.model.nets.SimpleCNN`: the class of what follows
            if name in options:
                continue
            if parser is not None and name.startswith("--") and "." in name:
                if (problem := self.key_problem(name[2:], class_paths, parser=parser)) is not None:
                    problems.append(f"`{prog}` does not take `{name}`: {problem}")
                continue
            problems.append(f"`{prog}` has no option `{name}`")
        return problems


# ------------------------------------------------------------------------------------------------------------
# 2. Config keys: in backticks, and in ```yaml blocks that are run configs
# ------------------------------------------------------------------------------------------------------------

def control_names(package: Path = PACKAGE) -> set[str]:
    """The dotted names lit-dist's run control speaks, which read like config keys but are none: event types
    (``Event("run.hung", ...)``), facts (``control.share("checkpoint.save_due", ...)``) and the summaries that
    ``run.finished`` carries in its data (``control.summarize("goodput", ...)``: `data.goodput`)."""
    found = set()
    for path in package.rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        if not re.search(r"\b(Event|share|summarize)\(", source):
            continue
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name in ("Event", "share"):
                found.add(node.args[0].value)
            elif name == "summarize":
                found.add(f"data.{node.args[0].value}")
    return found


def _code_reference(segments: list[str], package: Path = PACKAGE) -> bool:
    """Whether `a.b.c` names code of lit_dist rather than a key: a module (`data.dataset.centre_crop`, the module
    lit_dist/data/dataset.py) or a top-level name of one (`outage.call`)."""
    for i in range(len(segments), 0, -1):
        path = package.joinpath(*segments[:i])
        if i >= 2 and (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()):
            return True
        if i == 1 and path.with_suffix(".py").is_file() and len(segments) > 1:
            tree = ast.parse(path.with_suffix(".py").read_text(encoding="utf-8"))
            defined = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            names = {n.name for n in tree.body if isinstance(n, defined)}
            names |= {t.id for n in tree.body if isinstance(n, ast.Assign)
                      for t in n.targets if isinstance(t, ast.Name)}
            return segments[1] in names
    return False


def _yaml_keys(value, prefix: tuple[str, ...] = (), class_paths: dict | None = None):
    """(dotted key, class_paths) for every key of a YAML mapping; a class's init_args lie under its key, and each
    item of a list is checked on its own (its class_path, if any, applies to it alone)."""
    class_paths = dict(class_paths or {})
    if not isinstance(value, dict):
        if isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    yield from _yaml_keys(item, prefix, class_paths)
        return
    if prefix and ("class_path" in value or "init_args" in value):
        if isinstance(value.get("class_path"), str):
            class_paths[".".join(prefix)] = value["class_path"]
        for name in value:
            if name not in ("class_path", "init_args"):
                yield ".".join((*prefix, str(name))), class_paths
        value = value.get("init_args") or {}
    for name, item in value.items():
        key = (*prefix, str(name))
        yield ".".join(key), class_paths
        if isinstance(item, dict | list):
            yield from _yaml_keys(item, key, class_paths)


def key_problems(files: Iterable[Path], schema: Schema, root: Path = REPO) -> list[str]:
    """Every config key named in the docs that the run config of `lit-dist fit` lacks."""
    names = control_names()
    problems = []
    for path in files:
        doc, found = read_doc(path, root), []
        for offset, content in doc.spans:
            m = KEY_TOKEN.fullmatch(" ".join(content.split()))
            key = m and (m["flag"] or m["key"])
            if not key or key.split(".")[0] not in schema.groups or not (problem := schema.key_problem(key)):
                continue
            segments = key.split(".")
            if m["key"] and (key in names or segments[-1].lower() in FILE_SUFFIXES or _code_reference(segments)):
                continue  # an event, a fact, a file (`model.pt`) or code (`data.dataset.centre_crop`): no key
            if len(segments) > 2 and (PACKAGE / segments[0]).is_dir() and schema.key_problem(".".join(segments[:2])):
                problem += f", nor code of lit_dist (there is no lit_dist/{segments[0]}/{segments[1]}.py)"
            found.append((doc.line_at(offset), problem))
        for block in doc.blocks:
            if block.lang in YAML_BLOCKS:
                found += _yaml_block_problems(block, schema)
        problems += [f"{doc.rel}:{line}: {problem}" for line, problem in sorted(found, key=lambda x: x[0])]
    return problems


def _yaml_block_problems(block: Block, schema: Schema) -> list[tuple[int, str]]:
    """(line, problem) for each key of a ```yaml block that is a run config (its top-level keys are all the
    run config's) that the run config lacks."""
    if not block.lines:
        return []
    first = block.lines[0][0]
    try:
        config = yaml.safe_load("\n".join(line for _, line in block.lines))
    except yaml.YAMLError:
        return []  # not YAML as written (an excerpt with `...`): nothing to check reliably
    if not isinstance(config, dict) or not config or not set(map(str, config)) <= schema.top_level:
        return []  # not a run config: a docker-compose file, a payload, a callback's own settings
    lines = [line for _, line in block.lines]
    problems = []
    for key, class_paths in _yaml_keys(config):
        if problem := schema.key_problem(key, class_paths):
            leaf = key.rsplit(".", 1)[-1]
            written = re.compile(rf"(^|[\s{{,-]){re.escape(leaf)}\s*:")  # `leaf:`, also in a {flow: mapping}
            index = next((i for i, line in enumerate(lines) if written.search(line)), 0)
            problems.append((first + index, problem))
    return list(dict.fromkeys(problems))


# ------------------------------------------------------------------------------------------------------------
# 3. Command lines in code blocks
# ------------------------------------------------------------------------------------------------------------

def _logical_lines(block: Block) -> list[tuple[int, str]]:
    """The block's lines with `\\` continuations joined; in a console transcript (a `$ ` prompt) only the
    prompted lines, the rest being output."""
    joined, pending, start = [], "", 0
    for number, line in block.lines:
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append((start, pending + line))
        pending = ""
    if pending:
        joined.append((start, pending))
    if any(text.lstrip().startswith("$ ") for _, text in joined):
        return [(n, text.lstrip()[2:]) for n, text in joined if text.lstrip().startswith("$ ")]
    return joined


def lit_dist_commands(line: str) -> list[list[str]]:
    """The arguments of each `lit-dist` command on a shell line (``srun lit-dist``, ``python -m lit_dist``,
    ``.venv/bin/lit-dist``, after ``A=b`` assignments or ``&&``), not counting output such as ``lit-dist: ...``."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: a sentence of output, not a command
        return []
    first, second = (tokens + ["", ""])[:2]
    if first.endswith(":") or Path(first).name == "lit-dist" and second.endswith(":"):
        return []  # lit-dist's own output, `lit-dist: ...` or `lit-dist scale: 2 devices ...`, whatever follows
    commands, current = [], []
    for token in [*tokens, ";"]:
        if token and set(token) <= set(";&|"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    found = []
    for words in commands:
        words = _drop_assignments(words)
        if not words:
            continue
        program = Path(words[0]).name
        if program == "lit-dist":
            args = words[1:]
        elif program in LAUNCHERS or re.fullmatch(r"python[\d.]*", program):
            at = next((i for i, w in enumerate(words) if Path(w).name == "lit-dist"
                       or (w == "lit_dist" and i and words[i - 1] == "-m")), None)
            if at is None:
                continue
            args = words[at + 1:]
        else:
            continue
        found.append([a.removeprefix("[").removesuffix("]") for a in args if a not in ("[", "]", "...")])
    return found


def _drop_assignments(words: list[str]) -> list[str]:
    """The command without the `NAME=value` assignments before it."""
    i = 0
    while i < len(words) and re.fullmatch(rf"{IDENT}=.*", words[i], re.S):
        i += 1
    return words[i:]


def command_problems(files: Iterable[Path], schema: Schema, root: Path = REPO) -> list[str]:
    """Every `lit-dist` command line in a shell code block, or in a code span of the text
    (`lit-dist report RUN_DIR --plot report.png`), that names no command or an option it lacks."""
    problems = []
    for path in files:
        doc = read_doc(path, root)
        lines = [(n, line) for block in doc.blocks if block.lang in SHELL_BLOCKS for n, line in _logical_lines(block)]
        lines += [(doc.line_at(offset), " ".join(content.split())) for offset, content in doc.spans]
        for number, line in sorted(lines, key=lambda x: x[0]):
            for args in lit_dist_commands(line):
                shown = " ".join(["lit-dist", *args])
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                problems += [f"{doc.rel}:{number}: {shown}: {p}" for p in schema.command_problems(args)]
    return problems


# ------------------------------------------------------------------------------------------------------------
# 4. Exit codes
# ------------------------------------------------------------------------------------------------------------

def exit_codes(package: Path = PACKAGE) -> dict[int, str]:
    """Every code lit-dist exits with: ExitCode's, and each literal ``sys.exit(N)`` / ``os._exit(N)`` in the
    package (130 after Ctrl-C, in cli.py)."""
    from lit_dist.errors import ExitCode

    codes = {int(c): f"ExitCode.{c.name}" for c in ExitCode}
    for path in package.rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        if "exit(" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("exit", "_exit") and node.args \
                    and isinstance(node.args[0], ast.Constant) and type(node.args[0].value) is int:
                codes.setdefault(node.args[0].value, f"{path.relative_to(package.parent)}:{node.lineno}")
    return codes


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def exit_code_problems(files: Iterable[Path], codes: Mapping[int, str], root: Path = REPO) -> list[str]:
    """Each exit-code table (a table whose first column is `code`) lists each of ``codes`` once, and no other."""
    problems, tables = [], 0
    for path in files:
        doc = read_doc(path, root)
        lines = doc.prose.split("\n")
        for i, line in enumerate(lines[:-1]):
            if line.lstrip().startswith("|") and re.fullmatch(r"\s*\|?[\s:|-]*-[\s:|-]*", lines[i + 1]) \
                    and _cells(line)[0].strip("`*_ ").lower() == "code":
                tables += 1
                problems += _exit_table_problems(doc.rel, lines, i, codes)
    if not tables:
        names = ", ".join(p.relative_to(root).as_posix() if p.is_relative_to(root) else str(p) for p in files)
        problems.append(f"no exit-code table (a table whose first column is `code`) in {names}")
    return problems


def _exit_table_problems(rel: str, lines: list[str], header: int, codes: Mapping[int, str]) -> list[str]:
    problems, rows = [], {}
    for j in range(header + 2, len(lines)):
        if not lines[j].lstrip().startswith("|"):
            break
        cell, where = _cells(lines[j])[0].strip("`*_ "), f"{rel}:{j + 1}"
        if not cell.isdigit():
            problems.append(f"{where}: exit-code row {cell!r} is not a number")
        elif int(cell) not in codes:
            problems.append(f"{where}: exit code {cell} is documented but lit-dist never exits with it")
        elif int(cell) in rows:
            problems.append(f"{where}: exit code {cell} has a second row (first: line {rows[int(cell)]})")
        else:
            rows[int(cell)] = j + 1
    return problems + [f"{rel}:{header + 1}: exit code {code} ({source}) has no row in this table"
                       for code, source in sorted(codes.items()) if code not in rows]


# ------------------------------------------------------------------------------------------------------------
# The checks on the docs as they are
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def schema():
    return Schema()


def _report(problems: list[str]) -> str:
    return f"{len(problems)} problems:\n" + "\n".join(problems)


def test_relative_links_reach_a_file_and_a_heading():
    problems = link_problems(doc_files())
    assert not problems, _report(problems)


def test_config_keys_named_in_the_docs_exist(schema):
    problems = key_problems(doc_files(), schema)
    assert not problems, _report(problems)


def test_lit_dist_command_lines_parse(schema):
    problems = command_problems(doc_files(), schema)
    assert not problems, _report(problems)


def test_exit_code_table_lists_every_exit_code():
    problems = exit_code_problems(doc_files(), exit_codes())
    assert not problems, _report(problems)


# ------------------------------------------------------------------------------------------------------------
# The checks can fail: each on tiny docs with one mistake beside what is right
# ------------------------------------------------------------------------------------------------------------

def _write(root: Path, files: dict[str, str]) -> list[Path]:
    paths = []
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths.append(path)
    return paths


def test_a_broken_link_or_anchor_is_reported_with_its_line(tmp_path):
    files = _write(tmp_path, {
        "README.md": "# Top\n\nSee [caches](docs/caches.md#build-once), [data](docs/data.md#the-table)\n"
                     "and [top](#top), [web](https://example.com/x.md#nowhere), [the\n"
                     "caches](docs/caches.md#caches).\n"
                     "\n```bash\ncat [not a link](missing.md)\n```\n",
        "docs/caches.md": "# Caches\n\n## Build it once\n\n## Build it once\n\n[back](../README.md#top) "
                          "[again](#build-it-once-1) [`code`](#caches) `[no](link.md)` [up](../docs)\n"
                          "[wrong](README.md)\n",
    })
    assert link_problems(files, tmp_path) == [
        'README.md:3: link to docs/caches.md#build-once has no heading "build-once" in docs/caches.md '
        "(did you mean #build-it-once?)",
        "README.md:3: link to docs/data.md#the-table: there is no docs/data.md",
        "docs/caches.md:8: link to README.md: there is no docs/README.md",
    ]


def test_slugs_follow_github():
    assert slug("Checking a run before it starts: `lit-dist plan`") == "checking-a-run-before-it-starts-lit-dist-plan"
    assert slug("`lit-dist report RUN_DIR`: a run at a glance") == "lit-dist-report-run_dir-a-run-at-a-glance"
    assert slug("lit-dist at 1,000 GPUs, on paper") == "lit-dist-at-1000-gpus-on-paper"
    assert slug("1. Event schema (version 1) -- [see](x.md)") == "1-event-schema-version-1----see"


def test_an_unknown_key_is_reported_and_real_ones_pass(schema, tmp_path):
    files = _write(tmp_path, {"docs/config.md": (
        "Set `data.cache.mode: build`, `checkpoint.async_save`, `trainer.max_steps`, `watchdog.timeout_s`,\n"
        "`--model.optimizer.init_args.lr 0.1` and `data.cache.mood`; `run.hung` is an event, `model.pt` a file,\n"
        "`data.dataset` code, `torch.save` no key, `data.nowhere.thing` neither.\n\n"
        "```yaml\nmodel:\n  net:\n    class_path: lit_dist.model.nets.SimpleCNN\n    init_args: {num_classes: 10}\n"
        "data:\n  batch_size_per_device: 8\n  cache: {mode: build}\ncheckpoint:\n  keep_last: 3\n```\n\n"
        "```yaml\nservices:\n  lit: {image: x, keep_last: 3}\n```\n")})
    assert key_problems(files, schema, tmp_path) == [
        "docs/config.md:2: `data.cache.mood` is not a key of the run config (did you mean `data.cache.mode`?)",
        "docs/config.md:3: `data.nowhere.thing` is not a key of the run config (did you mean `data.resolution`?), "
        "nor code of lit_dist "
        "(there is no lit_dist/data/nowhere.py)",
        "docs/config.md:14: `checkpoint.keep_last` is not a key of the run config "
        "(did you mean `checkpoint.keep_last_n`?)",
    ]


def test_keys_beneath_a_class_resolve_through_its_init_args(schema):
    assert schema.key_problem("data.cache.mode") is None  # data: BucketDataModule, its default class
    assert schema.key_problem("data.init_args.cache.mode") is None
    assert schema.key_problem("model.optimizer.init_args.lr") is None  # the default optimizer, AdamW
    assert schema.key_problem("model.optimizer.lr") is None
    assert schema.key_problem("model.optimizer.init_args.lrr") is not None
    assert schema.key_problem("model.net.init_args.num_classes", {"model.net": "lit_dist.model.nets.SimpleCNN"}) is None
    assert schema.key_problem("model.net.init_args.depth", {"model.net": "lit_dist.model.nets.SimpleCNN"}) is not None
    assert schema.key_problem("trainer.max_steps.value") is not None


def test_an_unknown_command_or_flag_is_reported(schema, tmp_path):
    files = _write(tmp_path, {"README.md": (
        "```console\n"
        "$ FOO=1 srun lit-dist fit --config <run dir>/cfg.yaml --trainer.max_steps -1 \\\n"
        "    --data.cache.mode build --trainer.max_stepz 3   # a comment --nope\n"
        "lit-dist: fit finished: this is output --nope\n"
        "$ .venv/bin/python -m lit_dist cache --config cfg.yaml [--check] --trainer.devices=4\n"
        "$ bash .ci/setup && lit-dist report RUN_DIR --plot report.png --plt x\n"
        "$ lit-dist fitt --config cfg.yaml\n"
        "lit-dist scale: 1 device, 36 steps ...\n"
        "```\n\n"
        "```\nlit-dist --help\nlit-dist plan --config cfg.yaml --devices 4\n```\n\n"
        "```python\nlit-dist fit --nope\n```\n\n"
        "Run `lit-dist COMMAND --help`, `lit-dist export CKPT --output model.pt` or `lit-dist index --outptu x`.\n")})
    assert command_problems(files, schema, tmp_path) == [
        "README.md:2: lit-dist fit --config <run dir>/cfg.yaml --trainer.max_steps -1 --data.cache....: "
        "`lit-dist fit` does not take `--trainer.max_stepz`: `trainer.max_stepz` is not a key of the run config "
        "(did you mean `trainer.max_steps`?)",
        "README.md:6: lit-dist report RUN_DIR --plot report.png --plt x: `lit-dist report` has no option `--plt`",
        "README.md:7: lit-dist fitt --config cfg.yaml: lit-dist has no command `fitt` (its commands: fit, validate, "
        "test, predict, plan, index, export, report, scale, preflight, sample, cache)",
        "README.md:13: lit-dist plan --config cfg.yaml --devices 4: `lit-dist plan` has no option `--devices`",
        "README.md:20: lit-dist index --outptu x: `lit-dist index` has no option `--outptu`",
    ]


def test_exit_code_table_missing_or_extra_rows_are_reported(tmp_path):
    files = _write(tmp_path, {"docs/exit-codes.md": "# Exit codes\n\n| code | meaning |\n|---|---|\n| 0 | ok |\n"
                                                    "| `2` | config |\n| 5 | never |\n| 2 | again |\n"})
    codes = {0: "ExitCode.OK", 2: "ExitCode.CONFIG_ERROR", 130: "lit_dist/cli/app.py:9"}
    assert exit_code_problems(files, codes, tmp_path) == [
        "docs/exit-codes.md:7: exit code 5 is documented but lit-dist never exits with it",
        "docs/exit-codes.md:8: exit code 2 has a second row (first: line 6)",
        "docs/exit-codes.md:3: exit code 130 (lit_dist/cli/app.py:9) has no row in this table",
    ]
    readme = _write(tmp_path, {"README.md": "# No table here\n"})
    assert exit_code_problems(readme, codes, tmp_path) == [
        "no exit-code table (a table whose first column is `code`) in README.md"]


def test_exit_codes_include_the_ones_the_code_returns():
    codes = exit_codes()
    assert codes[130].startswith("lit_dist/cli/app.py:")  # Ctrl-C
    assert codes[0] == "ExitCode.OK"
