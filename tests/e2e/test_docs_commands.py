"""Issue 29, checks 2 and 3: every ``kforge`` command in the README, the docs site and the recipes' headers is what the
real CLI accepts (tests/docs_commands.py: parsed with ``--print_config`` or the tool's own parser, in-process; the CPU
tutorials are run as written by tests/e2e/test_docs_tutorials.py), the error examples print the field they show, and
a renamed option or subcommand makes the check fail (shown on temporary copies of a page and on a patched command
table)."""

from __future__ import annotations

import shutil

import pytest

from kempnerforge.commands import TOOLS
from tests.docs_commands import REPO, Command, check, doc_pages, page_commands, recipe_commands
from tests.e2e.inprocess import kforge_in_process

#: Pages whose CPU blocks tests/e2e/test_docs_tutorials.py runs as written.
EXECUTED_PAGES = ("docs/tutorials/pretrain.md", "docs/tutorials/finetune-chat.md")
#: Commands the docs show on purpose as wrong, with what kforge answers (the page quotes it).
SHOWN_WRONG = {("fitt",): "unknown command; did you mean fit?"}


def _documented() -> list[Command]:
    found = []
    for page in doc_pages():
        found += page_commands(page, executed=str(page.relative_to(REPO)) in EXECUTED_PAGES)
    for recipe in sorted((REPO / "configs").rglob("*.yaml")):
        found += recipe_commands(recipe)
    return found


def _parsed(commands: list[Command]) -> list[Command]:
    """The commands checked by parsing: not run by the tutorial test, not error examples, not shown wrong; once each."""
    seen, out = set(), []
    for cmd in commands:
        key = tuple(cmd.argv)
        if cmd.executed or cmd.expected_error or key in SHOWN_WRONG or key in seen:
            continue
        seen.add(key)
        out.append(cmd)
    return out


def test_every_documented_command_is_accepted_by_the_cli():
    commands = _parsed(_documented())
    assert len(commands) > 80, len(commands)  # README, docs and recipes: the check is not vacuous
    failures = [f"{cmd}\n    -> {err}" for cmd in commands if (err := check(cmd)) is not None]
    assert not failures, "\n".join(failures)


def test_the_tutorials_run_commands_are_the_pages_cpu_blocks():
    """The pages tests/e2e/test_docs_tutorials.py runs hold CPU blocks, and only those are exempt from parsing."""
    executed = [c for c in _documented() if c.executed]
    pages = {c.where.split(":")[0] for c in executed}
    assert pages == set(EXECUTED_PAGES), pages
    assert any(c.argv[:1] == ["fit"] for c in executed) and any(
        c.argv[:2] == ["convert", "dcp-to-hf"] for c in executed
    )


def _repo_like(tmp_path):
    """A working folder where configs/ and data/ are the repository's (nothing is written into the repository)."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "data").mkdir()
    for entry in (REPO / "data").iterdir():
        (tmp_path / "data" / entry.name).symlink_to(entry)
    return tmp_path


def test_error_examples_print_the_field_they_show(tmp_path):
    examples = [c for c in _documented() if c.expected_error]
    assert len(examples) >= 2, examples
    cwd = _repo_like(tmp_path)
    for cmd in examples:
        proc = kforge_in_process(*cmd.argv, cwd=cwd)
        assert proc.returncode == 2, (str(cmd), proc.stderr[-2000:])
        assert f"kforge: error: {cmd.expected_error}:" in proc.stderr, (str(cmd), proc.stderr[-2000:])


def test_commands_shown_wrong_are_refused_as_the_docs_say():
    shown = {tuple(c.argv) for c in _documented()} & set(SHOWN_WRONG)
    assert shown == set(SHOWN_WRONG), shown  # still on their page
    for argv, answer in SHOWN_WRONG.items():
        proc = kforge_in_process(*argv)
        assert proc.returncode == 2 and answer in proc.stderr, proc.stderr


def _page_copy(tmp_path, page: str, old: str, new: str):
    text = (REPO / page).read_text()
    assert old in text, f"{page} no longer shows {old!r}"
    copy = tmp_path / page
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text.replace(old, new))
    return copy


def test_a_renamed_field_or_subcommand_in_a_page_fails_the_check(tmp_path):
    """Check 3: the same page, copied, passes as written and fails once a field or a subcommand is renamed in it."""
    page = "docs/how-to/commands.md"
    shutil.copytree(REPO / "docs", tmp_path / "original" / "docs")
    intact = page_commands(tmp_path / "original" / page)
    assert all(check(c) is None for c in _parsed(intact))
    field = page_commands(_page_copy(tmp_path / "field", page, "--trainer.max_steps=50", "--trainer.max_stepz=50"))
    errors = [check(c) for c in _parsed(field) if "--trainer.max_stepz=50" in c.argv]
    assert len(errors) == 1 and "trainer.max_stepz" in errors[0], errors
    sub = page_commands(_page_copy(tmp_path / "sub", page, "kforge estimate --config", "kforge estimat --config"))
    errors = [check(c) for c in _parsed(sub) if c.argv[0] == "estimat"]
    assert len(errors) == 1 and "unknown subcommand 'estimat'" in errors[0], errors


def test_a_subcommand_renamed_in_the_code_fails_the_check(monkeypatch):
    """The other way round: the docs unchanged, the command table renames ``prepare-data``."""
    documented = [c for c in _parsed(_documented()) if c.argv[0] == "prepare-data" and len(c.argv) > 2]
    assert documented and all(check(c) is None for c in documented[:1])
    renamed = {("prepare-tokens" if name == "prepare-data" else name): tool for name, tool in TOOLS.items()}
    monkeypatch.setattr("kempnerforge.commands.TOOLS", renamed)  # a copy: the shared table keeps its order
    assert "unknown subcommand 'prepare-data'" in (check(documented[0]) or "")


@pytest.mark.parametrize("argv", [["fit", "--config", "configs/debug.yaml", "--model.config.n_layerz=2"]])
def test_a_renamed_config_field_is_refused_by_the_parse_the_check_uses(argv):
    """What the check relies on: `--print_config` refuses an unknown field in one line naming it."""
    err = check(Command(argv, "here"))
    assert err is not None and "model.config.n_layerz" in err, err
