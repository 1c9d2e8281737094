"""The documentation says what the code does.

docs/configuration.md's flags table is built from the live argparse parser of qvl/settings.py (this file builds it;
`QVL_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/test_docs.py` rewrites it), every flag of `--help` is in it, the
README's flags are real ones, every README code block is run by a test, and no page cites a file this repository
does not have.
"""
import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from qvl import settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
BEGIN = "<!-- BEGIN generated flags table: tests/test_docs.py builds it from qvl/settings.py; do not edit by hand -->"
END = "<!-- END generated flags table -->"
# Defaults that depend on the machine the parser runs on, as the table states them instead.
MACHINE_DEFAULTS = {"threads": "the cores available"}


class _Built(Exception):
    """Raised in place of parsing, once settings.parse() has built its parser."""


def live_parser(monkeypatch) -> argparse.ArgumentParser:
    """The parser settings.parse() builds, as it would be for a user with no QVL_* or GRADIO_* variables set."""
    for name in ("GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT"):
        monkeypatch.delenv(name, raising=False)
    built = []

    def capture(parser, *args, **kwargs):
        built.append(parser)
        raise _Built

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture), contextlib.suppress(_Built):
        settings.parse([], env={})
    assert built, "settings.parse() built no argparse parser"
    return built[0]


def shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An option's help as --help prints it, on one line."""
    try:
        text = parser._get_formatter()._expand_help(action)  # what --help prints: %(default)s filled in, %% as %
    except (AttributeError, KeyError, TypeError, ValueError):
        text = action.help.replace("%%", "%")
    return " ".join(text.split())


def flag_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    """(flags, environment variable, default, what) for every option of the parser, in --help's order."""
    home = os.path.expanduser("~")
    rows = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        text = shown_help(parser, action)
        text = re.sub(r" \(default: [^)]*\)$", "", text)  # BooleanOptionalAction's own suffix, where it adds one
        variable, default = "", ""
        found = re.search(r" ?\[env (QVL_\w+)(?:, default (.*))?\]$", text)
        if found:
            text, variable, default = text[:found.start()], found[1], found[2]
            default = "none, never shown" if default is None else default or "none"  # None: a secret
        elif action.default not in (None, argparse.SUPPRESS) and action.nargs != 0:
            default = str(action.default)
        default = MACHINE_DEFAULTS.get(action.dest, {"False": "off", "True": "on", "None": "none"}.get(default, default))
        if default.startswith(home):
            default = "~" + default[len(home):]
        flags = " / ".join(f"`{flag}`" for flag in action.option_strings)
        rows.append((flags, f"`{variable}`" if variable else "", f"`{default}`" if default else "",
                     text.replace("|", "\\|")))
    return rows


def flags_table(parser: argparse.ArgumentParser) -> str:
    lines = ["| flag | environment variable | default | what |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in flag_rows(parser)]
    return "\n".join([BEGIN, *lines, END])


def help_text(argv=("--help",)) -> str:
    """What `python app.py --help` prints (settings.parse is what app.py runs first), at a fixed width."""
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": "120"}), contextlib.redirect_stdout(out), \
            pytest.raises(SystemExit):
        settings.parse(list(argv), env={})
    return out.getvalue()


def test_the_configuration_page_holds_the_live_parsers_flags_table(monkeypatch):
    table = flags_table(live_parser(monkeypatch))
    page = CONFIGURATION.read_text()
    assert page.count(BEGIN) == 1 and page.count(END) == 1, f"{CONFIGURATION} lost its generated table's markers"
    generated = page[page.index(BEGIN):page.index(END) + len(END)]
    if os.environ.get("QVL_UPDATE_DOCS") == "1":
        CONFIGURATION.write_text(page.replace(generated, table))
        return
    assert generated == table, ("docs/configuration.md's flags table is not qvl/settings.py's: "
                                "QVL_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/test_docs.py rewrites it")


def test_every_flag_and_variable_of_help_is_on_the_configuration_page():
    text = help_text()
    options = text[text.index("\noptions:"):]
    flags = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", options))
    variables = set(re.findall(r"\bQVL_[A-Z][A-Z0-9_]*", " ".join(options.split())))
    assert {"--help", "--model", "--quant", "--no-cache"} <= flags and "QVL_MODEL" in variables
    page = CONFIGURATION.read_text()
    table = page[page.index(BEGIN):page.index(END)]
    assert not [flag for flag in flags if f"`{flag}`" not in table]
    assert not [variable for variable in variables if f"`{variable}`" not in table]


def test_every_qvl_variable_the_code_reads_is_on_the_configuration_page():
    sources = [ROOT / "app.py", *(ROOT / "qvl").rglob("*.py"), *(ROOT / "tests").glob("*.py"), ROOT / ".ci" / "run"]
    named = set()
    for source in sources:
        named |= set(re.findall(r"\bQVL_[A-Z][A-Z0-9_]*[A-Z0-9]\b", source.read_text()))
    page = CONFIGURATION.read_text()
    assert named and not sorted(name for name in named if f"`{name}`" not in page)


def readme_section(heading: str) -> str:
    """The README's `## heading` section, up to the next `## ` heading."""
    text = README.read_text()
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_flags_table_names_ten_real_flags_and_links_to_all_of_them(monkeypatch):
    section = readme_section("Flags")
    named = re.findall(r"^\| `(--[\w-]+)`", section, re.M)
    parser = live_parser(monkeypatch)
    real = {flag for action in parser._actions for flag in action.option_strings}
    assert len(named) == len(set(named)) == 10
    assert not [flag for flag in named if flag not in real]
    assert "docs/configuration.md" in section


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def commands(body: str) -> list[str]:
    """A shell block's commands: its lines, without comments and continuations."""
    body = body.replace("\\\n", " ")
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in body.splitlines()]
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]


# Each README command, and the test that runs it: (file, a string of that file showing it does). Commands whose test
# is this file run below.
RUN_BY = {
    # pip's resolver on requirements.txt against the CPU index (the install), and every test that launches app.py.
    "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/python app.py":
        ("tests/test_install.py", '"-r", str(tmp_path / "requirements.txt")'),
    "bash .ci/run": (".ci/run", 'exec .venv/bin/python -m pytest "$@"'),  # what CI runs, this suite included
    "QVL_API_KEY=s3cret python app.py": ("tests/test_openai_api.py", 'f"QVL_API_KEY={KEY} python app.py"'),
    "curl -sN http://127.0.0.1:7860/v1/chat/completions -H \"Authorization: Bearer s3cret\" -H \"Content-Type: "
    "application/json\" -H \"Accept-Language: zh-CN\" -d '{\"model\": \"qvl\", \"stream\": true, \"max_tokens\": 32, "
    "\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'":
        ("tests/test_openai_api.py", 'curl.replace("http://127.0.0.1:7860", here)'),
    ".venv/bin/python app.py --mcp": ("tests/test_mcp.py", "launch_app(*readme_flags()"),
    "QVL_BACKEND_KEY=s3cret python app.py --backend http://127.0.0.1:7860/v1 --port 7861":
        ("tests/test_remote.py", "QVL_BACKEND_KEY=\\S+ python app.py --backend"),
    ".venv/bin/python -m qvl.bench --random-weights --rows fp32,auto,auto-warm --runs 1":
        ("tests/test_bench.py", '"-m", "qvl.bench", "--model", str(tiny_dir), "--rows", "fp32,auto,auto-warm'),
    ".venv/bin/python -m qvl.stress": ("tests/test_stress.py", '"-m", "qvl.stress"'),
}


def test_every_readme_command_is_run_by_a_test():
    blocks = code_blocks(README.read_text())
    assert {language for language, _ in blocks} <= {"bash", "python", "json", "text"}  # text: no command
    found = [command for language, body in blocks if language == "bash" for command in commands(body)]
    assert not [command for command in found if command not in RUN_BY], "a README command no test runs"
    for command in found:
        where, evidence = RUN_BY[command]
        assert evidence in (ROOT / where).read_text(), f"{where} no longer runs {command!r}"


def test_the_readmes_test_command_is_what_ci_runs_and_the_install_keeps_the_cpu_torch_index():
    quickstart = readme_section("Quickstart")
    assert [commands(body) for language, body in code_blocks(quickstart)] == [
        ["python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/python app.py"],
        ["bash .ci/run"]]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in (ROOT / "requirements.txt").read_text()


@pytest.fixture(scope="module")
def app(launch_app):
    with launch_app("--max-new-tokens", "8") as running:
        yield running


def test_the_readmes_gradio_client_example_runs(app):
    [script] = [body for language, body in code_blocks(README.read_text())
                if language == "python" and "gradio_client" in body]
    assert 'Client("http://127.0.0.1:7860/")' in script
    done = subprocess.run([sys.executable, "-c", script.replace("http://127.0.0.1:7860/", app.url)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "first token" in done.stdout  # the stats line of the first answer, then the second's pieces


PAGES = [README, *sorted(DOCS.glob("*.md")), ROOT / "CHANGELOG.md"]
# Paths a page may name that are made at run time, not kept in the repository.
MADE = ("artifacts/", ".venv/", "~/", "/tmp/")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_page_cites_a_file_the_repository_does_not_have(page):
    text = page.read_text()
    assert "scratch" not in text.lower()
    links = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)
             if not target.startswith(("http://", "https://", "#", "mailto:"))]
    links += re.findall(r"<img src=\"([^\"]+)\"", text)
    paths = re.findall(r"`((?:qvl|tests|assets|docs|\.ci)/[\w./-]*[\w])`", text)
    paths += re.findall(r"`((?:app|requirements|requirements-test)\.(?:py|txt))`", text)
    missing = [path for path in links + paths if path and not path.startswith(MADE)
               and not (page.parent / path).exists() and not (ROOT / path).exists()]
    assert not missing


def test_the_readme_stays_a_users_guide():
    text = README.read_text()
    assert len(text.encode()) < 20_000  # depth goes to docs/
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text.replace(readme_section("Speed at a glance"), ""))
    for page in ("configuration", "api", "deploy", "memory-and-caches", "robustness", "architecture", "quantization",
                 "performance"):
        assert f"docs/{page}.md" in text and (DOCS / f"{page}.md").is_file()
