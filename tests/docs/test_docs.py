"""The docs work: every snippet runs, every config parses, every link resolves, the API page is current.

Snippets are the fenced code blocks of README.md and docs/*.md:

* ``python`` blocks of one page run in order in one namespace (like a notebook), in a temporary folder;
* a ``python`` block preceded by ``<!-- test: script ARGS -->`` is also saved as ``script.py`` and run as
  ``python script.py ARGS`` in a subprocess (for code that starts several processes: Lightning's launcher
  re-runs the script, which cannot happen inside pytest);
* ``bash`` blocks run with this interpreter's folder first on ``PATH``, in a temporary folder that links to
  the repository's ``examples/`` and ``docs/``;
* ``yaml`` blocks must parse; those that name a ``model`` ``class_path`` must also pass ``LightningCLI``'s
  own validation (``fit --print_config``);
* a block preceded by ``<!-- test: file NAME -->`` is a file the page asks the reader to save: it is written as
  ``NAME`` into the folder where the page's ``bash`` blocks run and its ``yaml`` blocks are validated (there,
  a ``class_path`` may name it), and is otherwise tested like any block of its language;
* a block preceded by ``<!-- skip-test -->`` is illustrative (launch commands, multi-node, multi-GPU, the
  quick start itself) and is not run.

Code blocks of docs/api.md are docstring illustrations fenced as ``text`` and are not run; the page itself is
checked against ``docs/make_api.py``. docs/benchmarks.md and docs/results.md (benchmark reports, whose
commands are the benchmarks themselves) are checked for links only.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.helpers import ROOT, load_module, run_group

DOCS = ROOT / "docs"
BENCHMARK_REPORTS = {"benchmarks.md", "results.md"}
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RUN_PAGES = [p for p in PAGES if p.name not in BENCHMARK_REPORTS and p.name != "api.md"]

FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(skip-test|test:\s*script(?P<args>[^>]*?)|test:\s*file\s+(?P<file>[\w.\-]+))\s*-->$")


class Block:
    def __init__(
        self, page: Path, line: int, lang: str, code: str, marker: str | None, args: str, file: str | None = None
    ) -> None:
        self.page, self.line, self.lang, self.code, self.marker, self.args = page, line, lang, code, marker, args
        self.file = file

    @property
    def skipped(self) -> bool:
        return self.marker == "skip-test"

    @property
    def script(self) -> bool:
        return self.marker is not None and re.match(r"test:\s*script", self.marker) is not None

    def __repr__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang})"


def blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    previous = ""
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        lang, start = match.group(1), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        marker = MARKER.match(previous)
        out.append(
            Block(
                page,
                start + 1,
                lang,
                "\n".join(body) + "\n",
                marker.group(1) if marker else None,
                (marker.group("args") or "").strip() if marker else "",
                marker.group("file") if marker else None,
            )
        )
        previous = ""
        i += 1
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", PL_DISABLE_FORK="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _workdir(tmp_path: Path, page: Path | None = None) -> Path:
    for name in ("examples", "docs"):
        (tmp_path / name).symlink_to(ROOT / name)
    for block in blocks(page) if page is not None else []:
        if block.file is not None:
            (tmp_path / block.file).write_text(block.code)
    return tmp_path


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
@pytest.mark.multiprocess
def test_python_snippets_run(page, tmp_path, monkeypatch):
    code_blocks = [b for b in blocks(page) if b.lang == "python" and not b.skipped]
    if not code_blocks:
        pytest.skip(f"{page.name} has no python snippets")
    monkeypatch.chdir(_workdir(tmp_path))
    namespace: dict = {"__name__": "docs_snippet"}
    for block in code_blocks:
        if block.script:
            path = tmp_path / "script.py"
            path.write_text(block.code)
            result = run_group([sys.executable, str(path), *block.args.split()], 300, cwd=tmp_path, env=_env())
            assert result.returncode == 0, f"{block}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(block.code, str(block), "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"snippet {block} failed: {type(error).__name__}: {error}") from error


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
@pytest.mark.multiprocess
def test_bash_snippets_run(page, tmp_path):
    code_blocks = [b for b in blocks(page) if b.lang in ("bash", "sh", "shell") and not b.skipped]
    if not code_blocks:
        pytest.skip(f"{page.name} has no runnable shell snippets")
    work = _workdir(tmp_path, page)
    for block in code_blocks:
        result = run_group(["bash", "-euo", "pipefail", "-c", block.code], 300, cwd=work, env=_env())
        assert result.returncode == 0, f"{block}: {result.stdout[-3000:]}{result.stderr[-3000:]}"


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
def test_yaml_snippets_are_valid_configs(page, tmp_path, monkeypatch):
    from lightning_async_pp.cli import main

    code_blocks = [b for b in blocks(page) if b.lang in ("yaml", "yml") and not b.skipped]
    if not code_blocks:
        pytest.skip(f"{page.name} has no yaml snippets")
    # A config may name a model file the page has the reader save; the CLI imports it from the current folder.
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(_workdir(work, page))
    monkeypatch.syspath_prepend(str(work))
    for block in blocks(page):
        if block.file is not None and block.file.endswith(".py"):
            monkeypatch.setitem(sys.modules, block.file[:-3], None)  # restored (removed) after the test
            del sys.modules[block.file[:-3]]
    for block in code_blocks:
        config = yaml.safe_load(block.code)
        assert isinstance(config, dict), block
        model = config.get("model")
        if not (isinstance(model, dict) and "class_path" in model):
            continue
        path = tmp_path / "config.yaml"
        path.write_text(block.code)
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(path), "--print_config"])
        assert exit_info.value.code in (0, None), f"{block}: LightningCLI rejected the config"


def test_every_snippet_is_run_or_marked():
    """A fenced block is python/bash/yaml (run or checked), text, or explicitly marked as illustrative."""
    for page in RUN_PAGES:
        for block in blocks(page):
            assert block.lang in ("python", "bash", "sh", "shell", "yaml", "yml", "text", ""), block
            if block.lang == "":
                # Unlabelled fences are formulas or output, never code to run.
                assert not re.search(r"^\s*(import |from \w+ import|python |\$ )", block.code, re.M), block


def test_quick_start_is_the_two_make_commands():
    def quick_start_commands(page: Path) -> list[str]:
        text = page.read_text()
        section = text.split("## Quick start", 1)[1]
        block = next(b for b in blocks(page) if b.lang == "bash" and b.code.strip() in section)
        return [line.split("#")[0].strip() for line in block.code.splitlines() if line.strip()]

    readme = quick_start_commands(ROOT / "README.md")
    assert readme == ["make train", "make test"]
    assert quick_start_commands(DOCS / "index.md") == readme
    makefile = (ROOT / "Makefile").read_text()
    for target in ("train", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile has no {target} target"


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target, _ in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        if Path(target).name in BENCHMARK_REPORTS and not (page.parent / target).exists():
            continue  # written by the benchmark runs; linked ahead of time
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def _slug(heading: str) -> str:
    # GitHub's (and mkdocs' toc) anchor of a heading: lower case, punctuation dropped, spaces to dashes.
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_anchors_resolve():
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            path = (page.parent / target) if target else page
            if not path.exists() or path.suffix != ".md":
                continue
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.name} links to {target}#{anchor}: no such heading"


def test_api_reference_is_current():
    make_api = load_module(DOCS / "make_api.py")
    assert (DOCS / "api.md").read_text() == make_api.render(), "docs/api.md is out of date: run python docs/make_api.py"


def test_concepts_figure_matches_the_simulator():
    make_figures = load_module(DOCS / "make_figures.py")
    sync, async_ = make_figures.results()
    concepts = (DOCS / "concepts.md").read_text()
    assert (DOCS / "images" / "schedules.png").exists()
    assert "make_figures.py" in concepts
    # The numbers the page quotes are the simulator's.
    for result in (sync, async_):
        assert f"{result.makespan:g}" in concepts, result.schedule.kind


def _argument_table(text: str, heading: str) -> dict[str, str]:
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M)
    return {name: cell.strip() for name, cell in rows}


def test_configuration_tables_list_every_argument_with_its_default():
    import inspect
    from datetime import timedelta

    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.demos import GPT, TextDataModule
    from lightning_async_pp.optim import DelayCorrected, Muon

    text = (DOCS / "configuration.md").read_text()
    for heading, cls in [
        ("`AsyncPipelineStrategy`", AsyncPipelineStrategy),
        ("`Muon`", Muon),
        ("`DelayCorrected`", DelayCorrected),
        ("`GPT` (demo model)", GPT),
        ("`TextDataModule` (demo data)", TextDataModule),
    ]:
        table = _argument_table(text, heading)
        parameters = {n: p for n, p in inspect.signature(cls).parameters.items() if n != "self"}
        assert set(table) == set(parameters), f"{heading}: table {sorted(table)} vs code {sorted(parameters)}"
        for name, parameter in parameters.items():
            cell = table[name]
            if parameter.default is inspect.Parameter.empty:
                assert cell == "(required)", (heading, name, cell)
                continue
            shown = yaml.safe_load(cell.strip("`"))
            default = parameter.default
            if isinstance(default, timedelta):
                hours, minutes, seconds = map(int, str(shown).split(":"))
                shown = timedelta(hours=hours, minutes=minutes, seconds=seconds)
            if isinstance(default, tuple):
                default = list(default)
            assert shown == default, f"{heading}: {name} documented as {cell}, default is {parameter.default!r}"


def test_mkdocs_nav_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = {page for entry in config["nav"] for page in entry.values()}
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages <= listed, f"pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed <= pages | BENCHMARK_REPORTS, (
        f"nav entries without a page: {sorted(listed - pages - BENCHMARK_REPORTS)}"
    )


def _leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*prefix, key))
    else:
        yield prefix, tree


def test_complete_config_is_the_quickstart_spelled_out():
    """configuration.md's complete config sets every value quickstart.yaml sets, to the same value, and spells
    out every strategy argument (but Lightning's plug-ins) with its default where the quickstart leaves it."""
    import inspect
    from datetime import timedelta

    from lightning_async_pp import AsyncPipelineStrategy

    text = (DOCS / "configuration.md").read_text()
    section = text.split("## A complete config", 1)[1]
    complete = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    quickstart = yaml.safe_load((ROOT / "examples/configs/quickstart.yaml").read_text())
    spelled = dict(_leaves(complete))
    for path, value in _leaves(quickstart):
        assert spelled.get(path, "(missing)") == value, f"{'.'.join(path)}: the quickstart sets {value!r}"

    plugins = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    parameters = {n: p for n, p in inspect.signature(AsyncPipelineStrategy).parameters.items() if n not in plugins}
    strategy = complete["trainer"]["strategy"]["init_args"]
    assert set(strategy) == set(parameters), f"spelled {sorted(strategy)}, arguments {sorted(parameters)}"
    given = quickstart["trainer"]["strategy"]["init_args"]
    for name, parameter in parameters.items():
        if name in given:
            continue
        shown, default = strategy[name], parameter.default
        if isinstance(default, timedelta):
            hours, minutes, seconds = map(int, str(shown).split(":"))
            shown = timedelta(hours=hours, minutes=minutes, seconds=seconds)
        assert shown == default, f"strategy.{name}: the complete config has {shown!r}, the default is {default!r}"


def test_paths_of_tests_named_in_the_project_exist():
    """A test file that a doc, a config or a comment points to is there (files move between tiers)."""
    named = re.compile(r"\btests/[\w/]+\.py\b")
    texts = [ROOT / "pyproject.toml", ROOT / "mkdocs.yml", ROOT / "Makefile", *PAGES]
    texts += [*ROOT.glob("lightning_async_pp/**/*.py"), *ROOT.glob("docs/*.py"), *ROOT.glob("benchmarks/*.py")]
    texts += [*ROOT.glob("scripts/*.py"), *ROOT.glob("tests/**/*.py")]
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in texts
        for name in named.findall(path.read_text())
        if not (ROOT / name).exists()
    ]
    assert not missing, f"stale test paths: {missing}"
