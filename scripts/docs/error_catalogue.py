"""The generated catalogue of ``kforge: error:`` lines: every place the code refuses input, found by reading the source.

What ``kforge`` prints as one line (``kempnerforge/cli_errors.py``): a :class:`~kempnerforge.errors.UserError` (or
subclass) with its field; the library's typed input errors (``USER_ERROR_TYPES``); a ``ValueError`` / ``TypeError``
/ ``FileNotFoundError`` raised while the config is parsed and checked, whose field ``infer_field`` reads from the
message; and the lines the tools print themselves. Each raise site gives one entry: the field, the message with
``<...>`` where the code fills in a value, the part of it that says what to do, where it is raised and which tests
assert it (a test file that holds a literal piece of the message).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path

#: Folders of the installed package, relative to the repository root.
SOURCE_DIRS = ("kempnerforge", "strategies", "callbacks")
#: Exceptions that are user errors only when raised during setup, with a field named in the message.
SETUP_TYPES = ("ValueError", "TypeError", "FileNotFoundError", "NotADirectoryError")
#: First parts of the fields a setup error can name (anything else is an internal check, not input).
CONFIG_ROOTS = ("model", "data", "trainer", "ckpt_path", "seed_everything")
#: Shortest literal piece of a message looked up in the tests (shorter ones match by chance).
MIN_PIECE = 20
#: Messages with less literal text than this are passed through from elsewhere (``print(f"...: {err}")``).
MIN_LITERAL = 12
#: Words of a clause that tells the user what to do.
ADVICE = re.compile(
    r"\b(allowed|use|set|give|add|remove|pass|run|choose|turn|lower|raise|resume|prepare|re-save|"
    r"export|install|shorten|drop|keep|start|delete|rename|fix)\b",
    re.I,
)


@dataclass
class Entry:
    """One refusal: ``field`` (``model.config.n_heads``; ``?`` when the code computes it), the message template,
    where it is raised (``path:line``) and the test files that assert it."""

    field: str
    message: str
    where: str
    tests: list[str] = dc_field(default_factory=list)

    @property
    def what_to_do(self) -> str:
        """The clauses of the message that say what is allowed or what to do instead, when it has them."""
        parts = re.split(r"(?<=[;:.])\s+", self.message)
        return " ".join(p for p in parts[1:] if ADVICE.search(p)).rstrip(";")


def _template(node: ast.expr | None, holes: bool = True) -> str | None:
    """A message as text with ``<expr>`` for each f-string hole (``holes=False``: ``<>``, so that a dotted expression
    is not read as a field); None when it is not a string literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                out.append(str(value.value))
            else:
                expr = ast.unparse(value.value) if holes else ""
                out.append(f"<{expr if len(expr) <= 24 else '...'}>")
        return "".join(out)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left, holes), _template(node.right, holes)
        return None if left is None or right is None else left + right
    return None


def _user_error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """``UserError`` and every class of the package that derives from it or from a typed input error."""
    from kempnerforge.cli_errors import USER_ERROR_TYPES

    names = {"UserError", *USER_ERROR_TYPES}
    changed = True
    while changed:
        changed = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in names:
                    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                    if bases & names:
                        names.add(node.name)
                        changed = True
    return names


def _call_name(call: ast.Call) -> str:
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")


def _entries_in(path: str, tree: ast.Module, user_types: set[str]) -> list[Entry]:
    from kempnerforge.cli_errors import _default_field, infer_field

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            call, name = node.exc, _call_name(node.exc)
            if name in user_types and len(call.args) >= 2 and name not in ("CheckpointError",):
                field_, message = _template(call.args[0]), _template(call.args[1])
                if message is not None and _literal_chars(message) >= MIN_LITERAL:
                    found.append(Entry(_field_text(field_), message, f"{path}:{node.lineno}"))
            elif (name in user_types or name in SETUP_TYPES) and call.args:
                message, bare = _template(call.args[0]), _template(call.args[0], holes=False)
                if message is None or _literal_chars(message) < MIN_LITERAL:
                    continue
                default = _default_field(type(name, (Exception,), {})()) if name in user_types else ""
                inferred = infer_field(bare, default=default)
                if name in user_types and inferred.split(".")[0] not in CONFIG_ROOTS:
                    inferred = default  # a dotted name in the message that is no field (np.load)
                if inferred and (name in user_types or inferred.split(".")[0] in CONFIG_ROOTS):
                    found.append(Entry(inferred, message.removeprefix(f"{inferred}: "), f"{path}:{node.lineno}"))
        elif isinstance(node, ast.Call) and _call_name(node) == "print" and node.args:
            text = _template(node.args[0])
            if text and text.startswith("kforge: error: "):
                rest = text.removeprefix("kforge: error: ")
                field_, _, message = rest.partition(": ")
                message = message or rest
                if _literal_chars(message) >= MIN_LITERAL:
                    found.append(
                        Entry(_field_text(field_ if message != rest else None), message, f"{path}:{node.lineno}")
                    )
    return found


def _literal_chars(message: str) -> int:
    return len(re.sub(r"<[^>]*>", "", message).strip())


def _field_text(field_: str | None) -> str:
    """The field as the entry shows it: ``(computed)`` when the code fills it in (``<name>``) or names none."""
    return "(computed)" if not field_ or "<" in field_ else field_


def _tests_asserting(message: str, tests: dict[str, str]) -> list[str]:
    pieces = [p.strip() for p in re.split(r"<[^>]*>", message) if len(p.strip()) >= MIN_PIECE]
    return sorted(name for name, text in tests.items() if any(p in text for p in pieces))


def catalogue(repo: Path) -> list[Entry]:
    """Every refusal in the package under ``repo``, sorted by field, each with the tests that assert it."""
    trees = {}
    for folder in SOURCE_DIRS:
        for path in sorted((repo / folder).rglob("*.py")):
            trees[path] = ast.parse(path.read_text(), str(path))
    user_types = _user_error_classes(trees)
    tests = {str(p.relative_to(repo)): p.read_text() for p in sorted((repo / "tests").rglob("test_*.py"))}
    entries = []
    for path, tree in trees.items():
        for entry in _entries_in(str(path.relative_to(repo)), tree, user_types):
            entry.tests = _tests_asserting(entry.message, tests)
            entries.append(entry)
    return sorted(entries, key=lambda e: (e.field.lstrip("-"), e.where))


def _group(entry: Entry) -> str:
    name = entry.field.lstrip("-")
    if entry.field.startswith("--"):
        return "Tool options (`--name`)"
    if name.startswith("model.config"):
        return "`model.config.*`"
    if name.startswith("trainer.strategy"):
        return "`trainer.strategy.*` (the mesh and the transform chain)"
    head = name.split(".")[0]
    return f"`{head}.*`" if "." in name else f"`{head}`"


def errors_markdown(repo: Path) -> str:
    """The page ``reference/errors.md``."""
    entries = catalogue(repo)
    groups: dict[str, list[Entry]] = defaultdict(list)
    for entry in entries:
        groups[_group(entry)].append(entry)
    tested = sum(bool(e.tests) for e in entries)
    out = [
        "# Error messages",
        "",
        "Every `kforge: error: <field>: <message>` the code can print before a run starts, found by reading the "
        f"source (`scripts/docs/error_catalogue.py`): {len(entries)} refusals, {tested} of them asserted by a test "
        "that holds a literal piece of the message. `<...>` is a value the code fills in. The message says what is "
        "allowed; the *what to do* column repeats that clause. Exit status 2, nothing was started or written "
        "([exit statuses](../how-to/exit-statuses.md)).",
        "",
    ]
    for title in sorted(groups):
        out += [f"## {title}", "", "| field | message | what to do | raised in | tested by |",
                "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for e in groups[title]:
            cells = [f"`{e.field}`", _cell(e.message), _cell(e.what_to_do), f"`{e.where}`",
                     "<br>".join(f"`{t}`" for t in e.tests)]  # fmt: skip
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("`", "'")
