"""The documentation site (docs/, issue 38).

- It builds as ``make docs`` builds it: Sphinx with warnings as errors (``-W``) and every
  cross-reference resolved (``-n``), and the generated pages say what they are generated from.
  ``make test`` builds it here, once.
- Every ``hvdtrain <command> --option`` that README.md and docs/**/*.md show, in code blocks and
  inline code, exists in the real parser (:func:`hvdtrain.cli.build_parser`): sub-command, option
  names, and literal values of options with choices.
- Every ``HVDTRAIN_*`` variable the code and scripts use is on the environment variables page.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import benchmark_pages  # noqa: E402  (docs/_ext)
import hvdtrain_docs  # noqa: E402
import schema_pages  # noqa: E402

# ---- the commands the docs show -----------------------------------------------------------------

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*\{?([\w+-]*)\}?.*$")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
# Code blocks in these languages hold no shell command lines.
NOT_SHELL = {"python", "py", "json", "toml", "ini", "cfg", "diff", "pycon"}
PLACEHOLDER = re.compile(r"[<>{}$*]|\.\.\.|^\[|\]$")
# A word after which "hvdtrain" is a file or package name, not the command.
NOT_COMMAND_BEFORE = {"cd", "cp", "ls", "mv", "rm", "mkdir", "install", "clone", "uninstall",
                      "show", "tar", "-e", "git", "which"}


def shown_commands(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of the shell command lines in a Markdown file's code blocks (backslash
    continuations joined) and of its inline code spans that mention hvdtrain."""
    found: list[tuple[int, str]] = []
    fence = None
    pending, start = "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = (match.group(2)[0], len(match.group(2)), match.group(3).lower())
            continue
        if fence is not None:
            if match and match.group(2)[0] == fence[0] and len(match.group(2)) >= fence[1] \
                    and not match.group(3):
                fence = None
                continue
            if fence[2] in NOT_SHELL:
                continue
            text = re.sub(r"^\s*(\$|>>>|%)\s+", "", line)
            if not pending:
                start = number
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
                continue
            found.append((start, pending + text))
            pending = ""
            continue
        for span in INLINE.findall(line):
            if "hvdtrain" in span:
                found.append((number, span))
    return found


def _tokens(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: words are good enough
        return text.split()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _literal(value: str) -> bool:
    return not PLACEHOLDER.search(value)


def _choices(action: argparse.Action) -> list[str]:
    """The values an option takes: argparse's choices, or those its metavar lists
    (``{torch,keras}``: hvdtrain train validates them itself, after parsing)."""
    if action.choices:
        return [str(c) for c in action.choices]
    metavar = action.metavar if isinstance(action.metavar, str) else ""
    match = re.fullmatch(r"\{([\w.,-]+)\}", metavar)
    return match.group(1).split(",") if match else []


def check_command(text: str, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """What is wrong with the hvdtrain command lines in ``text`` (a shell line): an unknown
    sub-command, an option the sub-command does not have, a literal value outside an option's
    choices. Commands after ``hvdtrain launch ... --`` are checked too."""
    parser = parser or build_parser()
    commands = _subparsers(parser)
    tokens = _tokens(text)
    problems = []
    for i, token in enumerate(tokens):
        if not (token == "hvdtrain" or token.endswith("/bin/hvdtrain")
                or (token == "hvdtrain.cli" and i > 0 and tokens[i - 1] == "-m")):
            continue
        if i > 0 and tokens[i - 1] in NOT_COMMAND_BEFORE:
            continue
        rest = []
        for word in tokens[i + 1:]:
            if word and all(c in "();<>|&" for c in word):
                break
            rest.append(word)
        if not rest:
            continue
        first = rest[0]
        if first.startswith("-"):
            sub, name, args = parser, "hvdtrain", rest
        elif re.fullmatch(r"[a-z][a-z-]*", first):
            if first not in commands:
                problems.append(f"'hvdtrain {first}': no such command "
                                f"(hvdtrain has {', '.join(sorted(commands))})")
                continue
            sub, name, args = commands[first], f"hvdtrain {first}", rest[1:]
        else:
            continue  # a placeholder (<command>) or a path
        options = {s: a for a in sub._actions for s in a.option_strings}
        for j, word in enumerate(args):
            if word == "--":
                break  # hvdtrain launch: the command it runs follows (checked on its own)
            if not word.startswith("-") or word == "-" or re.fullmatch(r"-[0-9.]+", word):
                continue
            option, has_value, value = word.partition("=")
            if not _literal(option):
                continue
            action = options.get(option)
            if action is None:
                problems.append(f"'{name}' has no option {option}")
                continue
            choices = _choices(action)
            if not has_value and action.nargs in (None, "?") and choices \
                    and j + 1 < len(args) and not args[j + 1].startswith("-"):
                value, has_value = args[j + 1], True
            if has_value and choices and _literal(value) and value not in choices:
                problems.append(f"'{name} {option} {value}': {value} is not one of "
                                f"{', '.join(choices)}")
    return problems


def doc_files() -> list[Path]:
    files = [ROOT / "README.md"] if (ROOT / "README.md").exists() else []
    return files + sorted(p for p in DOCS.rglob("*.md")
                          if "_build" not in p.parts and "generated" not in p.parts)


def test_checker_finds_what_drifted():
    """The check itself: misspelled options, unknown commands and bad choices are found, in
    continuation lines and behind launchers; placeholders and file names are not."""
    parser = build_parser()
    assert check_command("horovodrun -np 2 hvdtrain train --framework torch --dataset mnist",
                         parser) == []
    assert check_command("hvdtrain train --framwork torch", parser) == [
        "'hvdtrain train' has no option --framwork"]
    assert check_command("hvdtrain train --framework pytorch", parser) == [
        "'hvdtrain train --framework pytorch': pytorch is not one of torch, keras"]
    assert check_command("hvdtrain trian --framework torch", parser)[0].startswith(
        "'hvdtrain trian': no such command")
    assert check_command("hvdtrain launch --dry-run -np 2 -- hvdtrain train --epochz 3",
                         parser) == ["'hvdtrain train' has no option --epochz"]
    assert check_command("hvdtrain doctor --hostfile=hosts.txt --timeout 60", parser) == []
    assert check_command("hvdtrain train --framework <framework> --lr ${LR} ...", parser) == []
    assert check_command("cd hvdtrain && make test", parser) == []
    assert check_command("hvdtrain/   cli (parses, prints, runs)", parser) == []
    assert check_command(".venv/bin/hvdtrain traine", parser) != []
    assert check_command("hvdtrain report runs/a runs/b | sort", parser) == []
    assert check_command("hvdtrain --version", parser) == []
    assert check_command("hvdtrain --verbose", parser) == ["'hvdtrain' has no option --verbose"]


def test_checker_reads_markdown(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `hvdtrain doctor --hostfil h.txt` first.\n\n"
                    "```bash\n$ horovodrun -np 2 \\\n    hvdtrain train --framework keras \\\n"
                    "    --keras-backnd torch\n```\n\n"
                    "```python\nsubprocess.run(['hvdtrain', 'train', '--bad'])\n```\n")
    found = shown_commands(page)
    assert [n for n, _ in found] == [1, 4]
    problems = [p for _, text in found for p in check_command(text)]
    assert problems == ["'hvdtrain doctor' has no option --hostfil",
                        "'hvdtrain train' has no option --keras-backnd"]


def test_every_command_the_docs_show_exists():
    parser = build_parser()
    problems = [f"{path.relative_to(ROOT)}:{line}: {problem}  [{text.strip()}]"
                for path in doc_files()
                for line, text in shown_commands(path)
                for problem in check_command(text, parser)]
    assert not problems, "commands in the docs that hvdtrain does not have:\n" + "\n".join(problems)


# ---- environment variables ----------------------------------------------------------------------

def test_every_hvdtrain_variable_is_documented():
    """Every HVDTRAIN_* and GPU_CHECK_* variable the project's code, scripts and Makefile name is
    in docs/reference/environment.md."""
    names = r"\b(?:HVDTRAIN|GPU_CHECK)_[A-Z0-9_]*[A-Z0-9]\b"
    used = set()
    for folder in ("hvdtrain", "scripts", "slurm", "docker", "benchmarks"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".sbatch", ".yaml", ".yml") \
                    and "__pycache__" not in path.parts:
                used |= set(re.findall(names, path.read_text(errors="replace")))
    used |= set(re.findall(names, (ROOT / "Makefile").read_text()))
    page = (DOCS / "reference" / "environment.md").read_text()
    missing = sorted(v for v in used if f"`{v}`" not in page)
    assert not missing, f"add to docs/reference/environment.md: {', '.join(missing)}"


# ---- the generated parts ------------------------------------------------------------------------

def test_metrics_schema_is_described_field_by_field():
    source = (ROOT / schema_pages.REPORT).read_text()
    for name in ("RunHeader", "EpochMetrics"):
        table, problems = schema_pages.field_table(source, name)
        assert problems == []
        fields = [f for f, _, _ in schema_pages.dataclass_fields(source, name)]
        assert [re.match(r"\| `(\w+)`", row).group(1)
                for row in table.splitlines()[2:]] == fields
    # A field the page does not describe is named, with what to do.
    _, problems = schema_pages.field_table(
        source.replace("    hosts: int\n", "    hosts: int\n    new_field: int\n", 1), "RunHeader")
    assert problems == ["hvdtrain/run/report.py RunHeader.new_field has no description: add it "
                        "to DESCRIPTIONS in docs/_ext/schema_pages.py"]


def test_short_references_resolve_to_the_nearest_object():
    names = ["hvdtrain.torch.distribute", "hvdtrain.torch.adapter.distribute",
             "hvdtrain.keras.distribute", "hvdtrain.keras.adapter.distribute",
             "hvdtrain.run.report.RunHeader"]
    resolve = hvdtrain_docs.resolve_short_name
    assert resolve("distribute", "hvdtrain.keras.optimizer", names) == "hvdtrain.keras.distribute"
    assert resolve("distribute", "hvdtrain.torch.scheduler", names) == "hvdtrain.torch.distribute"
    assert resolve("distribute", "hvdtrain.run.training", names) is None  # ambiguous
    assert resolve("~RunHeader", "hvdtrain.run.elastic", names) == "hvdtrain.run.report.RunHeader"
    assert resolve("Nothing", "hvdtrain.run", names) is None
    assert hvdtrain_docs.summary("``a --b ...\n-c``, then. More.") == "``a --b ... -c``, then."


def test_benchmark_pages_come_from_the_json(tmp_path):
    bench = ROOT / "benchmarks"
    pages = benchmark_pages.write_pages(bench, tmp_path)
    assert sorted(p.stem for p in pages) == sorted(
        p.stem for p in (bench / "results").glob("*.json"))
    for page in pages:
        text = page.read_text()
        data = json.loads((bench / "results" / f"{page.stem}.json").read_text())
        assert "## Rerun" in text and "recorded" in text
        if isinstance(data.get("args"), dict):
            command = re.search(r"```bash\n(.*)\n```", text).group(1)
            name = benchmark_pages.SCRIPTS.get(page.stem, page.stem)
            script = (bench / f"{name}.py").read_text()
            for option in re.findall(r"(--[a-z-]+)", command):
                assert f'"{option}"' in script, (page.stem, option)
        for key, value in data.get("machine", {}).items():
            assert f"| {key} | " in text
        if (bench / "results" / f"{page.stem}.png").exists():
            assert f"benchmarks/results/{page.stem}.png)" in text
    # A figure on a page is the JSON's own: the scaling efficiencies, formatted.
    scaling = json.loads((bench / "results" / "scaling.json").read_text())
    text = (tmp_path / "scaling.md").read_text()
    for row in scaling["results"]:
        assert benchmark_pages.fmt(row["efficiency"]) in text


# ---- the build ----------------------------------------------------------------------------------

def test_docs_build_with_warnings_as_errors(tmp_path):
    """What ``make docs`` runs, into a fresh directory: no warning, every reference resolved."""
    if importlib.util.find_spec("sphinx") is None:
        pytest.fail("Sphinx is not installed here: `make docs` installs requirements/docs.txt "
                    "into .venv (or: pip install -r requirements/docs.txt)")
    out = tmp_path / "html"
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-n", "-W", "--keep-going", "-E", "-q",
                           "-b", "html", str(DOCS), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stderr[-6000:]}"
    cli = (out / "reference" / "cli.html").read_text()
    for action in build_parser()._actions:
        for command, sub in (getattr(action, "choices", None) or {}).items():
            for sub_action in sub._actions:
                if sub_action.help != argparse.SUPPRESS:
                    for option in sub_action.option_strings:
                        assert option in cli, (command, option)
    metrics = (out / "reference" / "metrics.html").read_text()
    for field, _, _ in schema_pages.dataclass_fields(
            (ROOT / schema_pages.REPORT).read_text(), "RunHeader"):
        assert f">{field}<" in metrics, field
    assert (out / "reference" / "api" / "hvdtrain" / "torch" / "index.html").exists()
    for results in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert (out / "benchmarks" / "generated" / f"{results.stem}.html").exists()
