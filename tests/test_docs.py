"""The docs against the code: the findings table (docs/findings.md) against
ckptfix.core.findings.CODES, the validation-rule list (docs/findings.md) against the rules the
source can raise, and each command's synopsis (its page: docs/inspect.md, fix.md, reshard.md,
convert.md, hash.md) against the options its --help shows. A drift fails here instead of
misleading a user.

Each check is a function from a page's text to a list of differences, so the tests below
can also feed it an edited page and prove that it notices.
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass, field
from functools import cache

import pytest

from tests.docs_pages import ROOT, page, section

PACKAGE = ROOT / "ckptfix"
COMMANDS = ["inspect", "fix", "reshard", "convert", "dedupe", "hash", "diff"]
FINDINGS = page("findings.md")
# The pages that document the commands, each with its synopsis (`dedupe` shares convert's,
# `diff` hash's).
SYNOPSIS_PAGES = ["inspect.md", "fix.md", "reshard.md", "convert.md", "hash.md"]
SYNOPSES = "\n".join(page(name) for name in SYNOPSIS_PAGES)


# --- (a) the findings table -----------------------------------------------------------------

FINDINGS_HEADING = "## Findings"
_ROW = re.compile(
    r"^\|\s*`(?P<code>[^`]+)`\s*\|\s*(?P<severity>[^|]+?)\s*\|\s*(?P<summary>.*?)\s*\|\s*$"
)


def documented_findings(text: str) -> list[tuple[str, str, str]]:
    """(code, severity, meaning) of each row of the findings table, in the page's order."""
    return [
        (match["code"], match["severity"], match["summary"])
        for line in section(text, FINDINGS_HEADING).splitlines()
        if (match := _ROW.match(line))
    ]


def findings_drift(text: str) -> list[str]:
    """How the findings table (docs/findings.md) differs from the records of the codes (core.codes):
    missing, unknown, doubled codes, wrong severities and meanings."""
    from ckptfix.core.codes import RECORDS

    rows = documented_findings(text)
    documented = {code: (severity, summary) for code, severity, summary in rows}
    drift = [
        f"{code}: listed twice"
        for code in sorted(documented)
        if [row[0] for row in rows].count(code) > 1
    ]
    drift += [f"{code}: not in the docs" for code in RECORDS if code not in documented]
    drift += [
        f"{code}: in the docs, not a finding code" for code in documented if code not in RECORDS
    ]
    for code, record in RECORDS.items():
        if code not in documented:
            continue
        severity, summary = documented[code]
        if severity != record.severity.value:
            drift.append(f"{code}: the docs say {severity}, the code says {record.severity.value}")
        if summary != record.summary:
            drift.append(f"{code}: the docs say {summary!r}, its record {record.summary!r}")
    return drift


def test_findings_table_lists_every_code_with_its_severity() -> None:
    assert findings_drift(FINDINGS) == []


def test_the_findings_check_sees_drift() -> None:
    assert documented_findings(FINDINGS)  # the table was found at all
    edited = FINDINGS.replace("| `dtype-mix` | info |", "| `dtype-mix` | warning |")
    edited = re.sub(r"^\| `non-finite` \|.*\n", "", edited, count=1, flags=re.MULTILINE)
    edited = edited.replace(
        "| `corrupt-file` |", "| `made-up` | error | never |\n| `corrupt-file` |"
    )
    edited = edited.replace(
        "| `empty-name` | warning | a tensor has an empty name |",
        "| `empty-name` | warning | a tensor has no name |",
    )
    assert findings_drift(edited) == [
        "non-finite: not in the docs",
        "made-up: in the docs, not a finding code",
        "empty-name: the docs say 'a tensor has no name', its record 'a tensor has an empty name'",
        "dtype-mix: the docs say warning, the code says info",
    ]


# --- (b) the validation rules ------------------------------------------------------------------

RULES_HEADING = "## Validation rules (`corrupt-file`)"


def documented_rules(text: str) -> set[str]:
    """Every rule name the rule list of docs/findings.md gives: the backticked names outside parentheses
    (inside them are examples, such as `true` or `-0`)."""
    body = section(text, RULES_HEADING)
    while True:  # innermost parentheses first, so nested ones go too
        stripped = re.sub(r"\([^()]*\)", "", body)
        if stripped == body:
            break
        body = stripped
    return set(re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)*)`", body))


@dataclass(eq=False)
class _Function:
    """A function, or a class's own __init__, of the package."""

    name: str
    positional: list[str]  # positional parameters as callers pass them (no self)
    keywords: list[str]  # keyword-only parameters
    node: ast.FunctionDef


@dataclass
class _Source:
    """What the package's source says about rules: its functions, classes and calls."""

    functions: dict[str, list[_Function]] = field(default_factory=dict)
    bases: dict[str, list[str]] = field(default_factory=dict)  # class -> its base names
    inits: dict[str, _Function] = field(default_factory=dict)  # class -> its own __init__
    # every call, with the function and the class it sits in
    calls: list[tuple[ast.Call, _Function | None, str | None]] = field(default_factory=list)


def _function(node: ast.FunctionDef, method: bool) -> _Function:
    names = [arg.arg for arg in [*node.args.posonlyargs, *node.args.args]]
    if method and names and names[0] in ("self", "cls"):
        names = names[1:]
    return _Function(node.name, names, [arg.arg for arg in node.args.kwonlyargs], node)


def _scan(tree: ast.AST, source: _Source) -> None:
    """Record the functions, classes and calls of one module."""

    def visit(node: ast.AST, function: _Function | None, klass: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                source.bases[child.name] = [b.id for b in child.bases if isinstance(b, ast.Name)]
                visit(child, function, child.name)
            elif isinstance(child, ast.FunctionDef):
                inner = _function(child, method=klass is not None and function is None)
                if klass is not None and function is None and child.name == "__init__":
                    source.inits[klass] = inner
                else:
                    source.functions.setdefault(child.name, []).append(inner)
                visit(child, inner, klass)
            else:
                if isinstance(child, ast.Call):
                    source.calls.append((child, function, klass))
                visit(child, function, klass)

    visit(tree, None, None)


@cache
def _package_source() -> _Source:
    source = _Source()
    for path in sorted(PACKAGE.rglob("*.py")):
        _scan(ast.parse(path.read_text(encoding="utf-8"), str(path)), source)
    return source


def _callee(call: ast.Call, klass: str | None) -> str | None:
    """The name a call calls; for super().__init__(...), the base class of `klass`."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if not isinstance(func, ast.Attribute):
        return None
    inner = func.value
    is_super = isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "super"
    if func.attr == "__init__" and is_super:
        return next(iter(_package_source().bases.get(klass or "", [])), None)
    return func.attr


def _targets(source: _Source, name: str) -> list[_Function]:
    """What calling `name` runs: a class's __init__ (its own or the nearest inherited one),
    or every package function of that name."""
    seen = set()
    while name in source.bases and name not in seen:
        seen.add(name)
        if name in source.inits:
            return [source.inits[name]]
        name = next(iter(source.bases[name]), "")
    return source.functions.get(name, []) if not seen else []


def _passed(call: ast.Call, function: _Function, param: str) -> list[ast.expr]:
    """What `call` (a call of `function`) passes for `param`."""
    passed = [k.value for k in call.keywords if k.arg == param]
    if param in function.positional and not any(isinstance(a, ast.Starred) for a in call.args):
        index = function.positional.index(param)
        passed += call.args[index : index + 1]
    return passed


Origin = tuple[str, str]  # (a rule, the name called with it where it is written)


def _values(
    source: _Source,
    expr: ast.expr,
    function: _Function | None,
    called: str,
    seen: frozenset[tuple[int, str]] = frozenset(),
) -> set[Origin]:
    """The strings `expr` (an argument of a call of `called`) can be, with the call each is
    written in: literals, either branch of `a if c else b` and `a or b`, f-strings over
    parameters, parameters (through what every caller passes) and local names (through
    what they are assigned). Anything else (an attribute such as `exc.rule`, carried from
    where that exception was made) adds nothing."""
    if isinstance(expr, ast.Constant):
        return {(expr.value, called)} if isinstance(expr.value, str) else set()
    if isinstance(expr, ast.IfExp | ast.BoolOp):
        parts = [expr.body, expr.orelse] if isinstance(expr, ast.IfExp) else expr.values
        return set().union(*(_values(source, part, function, called, seen) for part in parts))
    if isinstance(expr, ast.JoinedStr):
        return _fstring_values(source, expr, function, called, seen)
    if not isinstance(expr, ast.Name) or function is None:
        return set()
    if (id(function), expr.id) in seen:
        _TRACE.cuts += 1
        return set()
    # Each (function, name, called) is worked out once: without this the search walked every
    # path of the call graph again (82 s by the end of round 3). A result reached without
    # cutting a cycle does not depend on `seen`, so it is kept; one that cut a cycle is not.
    key = (id(function), expr.id, called)
    if key in _TRACE.known:
        return _TRACE.known[key]
    cuts = _TRACE.cuts
    found = _name_values(source, expr.id, function, called, seen | {(id(function), expr.id)})
    if _TRACE.cuts == cuts:
        _TRACE.known[key] = found
    return found


def _fstring_values(
    source: _Source,
    expr: ast.JoinedStr,
    function: _Function | None,
    called: str,
    seen: frozenset[tuple[int, str]],
) -> set[Origin]:
    pieces = [
        _values(source, p.value if isinstance(p, ast.FormattedValue) else p, function, called, seen)
        for p in expr.values
    ]
    return {
        ("".join(value for value, _ in choice), choice[0][1] if choice else called)
        for choice in itertools.product(*pieces)
    }


def _name_values(
    source: _Source, name: str, function: _Function, called: str, seen: frozenset[tuple[int, str]]
) -> set[Origin]:
    """What a name can be: a parameter (what every caller passes) or a local (what it is
    assigned)."""
    found: set[Origin] = set()
    if name in function.positional + function.keywords:
        for call, caller, callee in _calls_of().get(id(function), []):
            for passed in _passed(call, function, name):
                found |= _values(source, passed, caller, callee, seen)
        return found
    for value in _assignments(function).get(name, []):
        found |= _values(source, value, function, called, seen)
    return found


@dataclass
class _Trace:
    """What the value search has worked out, and how many cycles it has cut."""

    known: dict[tuple[int, str, str], set[Origin]] = field(default_factory=dict)
    cuts: int = 0


_TRACE = _Trace()


@cache
def _assignments(function: _Function) -> dict[str, list[ast.expr]]:
    """local name -> the values a function assigns to it (`name = ...`)."""
    assigned: dict[str, list[ast.expr]] = {}
    for node in ast.walk(function.node):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
    return assigned


@cache
def _calls_of() -> dict[int, list[tuple[ast.Call, _Function | None, str]]]:
    """id of a package function -> the calls that run it, each with the function it sits in
    and the name it calls: found once, not by a scan of every call per parameter."""
    source = _package_source()
    calls: dict[int, list[tuple[ast.Call, _Function | None, str]]] = {}
    for call, caller, klass in source.calls:
        callee = _callee(call, klass)
        for target in [] if callee is None else _targets(source, callee):
            calls.setdefault(id(target), []).append((call, caller, callee))
    return calls


@cache
def code_rules() -> dict[str, set[str]]:
    """rule -> the names called with it (the exception classes, or helpers such as _bad),
    from the source: every argument passed as the parameter `rule` of a package class or
    function (CorruptFileError(path, rule, ...), PickleRejected(rule, what), rule=...)."""
    source = _package_source()
    rules: dict[str, set[str]] = {}
    for call, function, klass in source.calls:
        name = _callee(call, klass)
        if name is None:
            continue
        passed = [k.value for k in call.keywords if k.arg == "rule"]
        for target in _targets(source, name):
            passed += [] if "rule" in target.keywords else _passed(call, target, "rule")
        for expr in passed:
            for rule, origin in _values(source, expr, function, name):
                rules.setdefault(rule, set()).add(origin)
    return rules


def _own_code_rules() -> set[str]:
    """Rules raised only through CorruptFileError subclasses that report under their own
    finding code (a Git LFS stub, a name stored twice), or by a rewrite refusing its input
    for a finding (InputRefusedError names the finding's code): the findings table
    documents them."""
    from ckptfix.core import errors

    own = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, errors.CorruptFileError)
        and value.code != errors.CorruptFileError.code
    } | {"InputRefusedError"}
    return {rule for rule, raisers in code_rules().items() if raisers <= own}


def rules_missing_from(text: str) -> list[str]:
    """Rules the code can raise that the rule list of docs/findings.md does not name."""
    from ckptfix.core.findings import CODES

    own = _own_code_rules()
    assert own <= set(CODES), own  # documented as finding codes instead
    return sorted(set(code_rules()) - own - documented_rules(text))


def rules_unknown_in(text: str) -> list[str]:
    """Rules the docs name that the code never raises."""
    return sorted(documented_rules(text) - set(code_rules()))


@pytest.mark.slow
def test_the_rule_collection_resolves_what_the_source_builds() -> None:
    """Literals, f-strings over parameters (`{what}-too-large`, `compressed-{kind}`),
    rule= keywords, exceptions that carry a rule to CorruptFileError, and helpers."""
    rules = code_rules()
    for rule in [
        "too-small",  # CorruptFileError(path, "too-small", ...)
        "index-too-large",  # f"{what}-too-large", what="index" at the call site
        "config-too-large",
        "compressed-pickle",  # f"compressed-{kind}" through _entry_start's callers
        "compressed-storage",
        "zip-encrypted",  # through the _bad(display, rule, what) helper
        "duplicate-key",  # _JsonRejected(rule, what), re-raised as CorruptFileError
        "bad-pickle",  # PickleTruncated's super().__init__("bad-pickle", what)
        "header-too-large",  # PlanError(..., rule="header-too-large")
        "index-not-json",  # rule = exc.rule or "index-not-json"
    ]:
        assert rule in rules, rule
    assert {"lfs-pointer", "duplicate-name"} <= _own_code_rules()
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule) for rule in rules), sorted(rules)


@pytest.mark.slow  # code_rules(): seconds of static analysis, shared by the rule tests
def test_every_rule_named_in_the_readme_exists_in_the_code() -> None:
    assert rules_unknown_in(FINDINGS) == []


@pytest.mark.slow  # code_rules(): seconds of static analysis, shared by the rule tests
def test_every_rule_the_code_raises_is_in_the_readme() -> None:
    assert rules_missing_from(FINDINGS) == []


@pytest.mark.slow  # code_rules(): seconds of static analysis, shared by the rule tests
def test_the_rule_checks_see_drift() -> None:
    assert "too-small" in documented_rules(FINDINGS)  # the list was found at all
    assert "true" not in documented_rules(FINDINGS)  # `true` is an example inside parentheses
    dropped = FINDINGS.replace("`too-small` (under 8 bytes), ", "")
    assert "too-small" in rules_missing_from(dropped)
    assert "too-small" not in rules_missing_from(FINDINGS)
    added = FINDINGS.replace("`unreadable`.", "`unreadable`, `no-such-rule`.")
    assert rules_unknown_in(added) == ["no-such-rule"]


# --- (c) the command synopses --------------------------------------------------------------


def synopses(text: str) -> dict[str, list[str]]:
    """command -> its synopses in the code blocks of the command pages: a line `ckptfix CMD ARG ...` whose
    argument is a metavar in capitals (not an example such as `ckptfix inspect ./model`),
    joined with its indented continuation lines."""
    found: dict[str, list[list[str]]] = {}
    fenced = False
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            fenced, current = not fenced, None
        elif fenced and (match := re.match(r"ckptfix (\w+)\s+[A-Z]+\b", line)):
            current = [line]
            found.setdefault(match[1], []).append(current)
        elif current is not None and line.startswith(" ") and line.strip():
            current.append(line)
        else:
            current = None
    return {command: [" ".join(lines) for lines in each] for command, each in found.items()}


def synopsis_options(synopsis: str) -> set[str]:
    """The option names a synopsis shows: `--name` and `-o`, not words like `fp16`."""
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", synopsis))


@cache
def command_options() -> dict[str, list[list[str]]]:
    """command -> the names of each of its options, from the typer app (what --help shows,
    --help itself aside)."""
    import typer.main

    from ckptfix.cli.app import app

    group = typer.main.get_command(app)
    commands = getattr(group, "commands", {})
    return {
        name: [
            [*param.opts, *param.secondary_opts]
            for param in command.params
            if param.param_type_name == "option" and not getattr(param, "hidden", False)
        ]
        for name, command in commands.items()
    }


def synopsis_drift(text: str, command: str) -> list[str]:
    """How the docs' synopsis of `command` differs from its options."""
    found = synopses(text).get(command, [])
    if len(found) != 1:
        return [f"{command}: {len(found)} synopses in the docs"]
    named = synopsis_options(found[0])
    options = command_options()[command]
    known = {name for names in options for name in names}
    drift = [f"{command}: {'/'.join(names)} missing" for names in options if not named & set(names)]
    drift += [f"{command}: {name} is not an option" for name in sorted(named - known)]
    return drift


def test_every_command_has_a_synopsis() -> None:
    assert sorted(command_options()) == sorted(COMMANDS)
    assert sorted(synopses(SYNOPSES)) == sorted(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_synopsis_lists_exactly_the_options(command: str) -> None:
    assert synopsis_drift(SYNOPSES, command) == []


def test_the_synopsis_check_sees_drift() -> None:
    edited = SYNOPSES.replace("[--hash] ", "").replace(
        "[--scan-values]", "[--scan-values] [--bogus]"
    )
    assert synopsis_drift(edited, "inspect") == [
        "inspect: --hash missing",
        "inspect: --bogus is not an option",
    ]
    continued = SYNOPSES.replace("[--in-place]\n", "\n", 1)  # on the continuation line
    assert synopsis_drift(continued, "reshard") == ["reshard: --in-place missing"]
    assert synopsis_drift(
        SYNOPSES.replace("ckptfix dedupe  SRC", "ckptfix dedupe  ./x"), "dedupe"
    ) == ["dedupe: 0 synopses in the docs"]
