"""The README and docs/ stay true: their code runs or imports, their links resolve."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _snippet(after: str, page: str = "README.md", language: str = "python") -> str:
    """The first ``language`` code block of ``page`` after the text ``after``."""
    text = (ROOT / page).read_text()
    start = text.index(after)
    return re.search(rf"```{language}\n(.*?)```", text[start:], re.S).group(1)


def _imports_of(code: str) -> dict:
    """Runs only the import statements of ``code``; the names they bound."""
    tree = ast.parse(code)
    imports = ast.Module(
        body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[]
    )
    namespace: dict = {}
    exec(compile(imports, "snippet", "exec"), namespace)
    return namespace


def test_the_plain_pytorch_snippet_runs_and_prints_a_plan() -> None:
    code = _snippet("This runs as is from the repository root", page="docs/plain-pytorch.md")
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, *table = done.stdout.splitlines()
    assert first.split()[0] in {"planned", "control"}
    assert re.match(r"TapeSAC plan for up to \d+ \(DecoderLayer\) tokens: capacity", table[0])


def test_the_lightning_snippet_parses_and_its_imports_resolve() -> None:
    namespace = _imports_of(_snippet("## Quick start: Lightning"))
    assert namespace["TapeSACFSDPStrategy"].__module__ == "tapesac_lightning.lightning_strategy"


def test_the_trainer_snippet_parses_and_its_import_resolves() -> None:
    namespace = _imports_of(_snippet("## Quick start: Hugging Face Trainer"))
    assert namespace["TapeSACTrainerCallback"].__module__ == "tapesac_lightning.hf_trainer"


def test_the_lightning_guide_names_only_arguments_the_strategy_takes() -> None:
    from tapesac_lightning import TapeSACFSDPStrategy

    code = _snippet("## Arguments", page="docs/lightning.md")
    exec(code, {"TapeSACFSDPStrategy": TapeSACFSDPStrategy})


@pytest.mark.parametrize("page", ["README.md", "docs/accelerate.md"])
def test_the_accelerate_yaml_is_the_example_config_and_its_settings_are_valid(page: str) -> None:
    yaml = pytest.importorskip("yaml")
    from tapesac_lightning.accelerate import TapeSACPlugin, check_fsdp2, split_config

    shown = yaml.safe_load(_snippet("Quick start", page=page, language="yaml"))
    example = yaml.safe_load((ROOT / "examples" / "accelerate_tapesac.yaml").read_text())
    assert shown == example
    rest, ours = split_config(shown)
    check_fsdp2(rest)
    assert TapeSACPlugin.from_keys(ours).config().full_control_every == 25


def test_every_python_block_in_the_pages_parses() -> None:
    for page in PAGES:
        for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            ast.parse(code, filename=str(page.relative_to(ROOT)))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _links(page: Path) -> list[str]:
    """Relative link targets of ``page`` outside code (web addresses left out)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def test_the_anchor_of_a_heading_is_githubs() -> None:
    assert _anchor("What is always saved (the mandatory set S0)") == (
        "what-is-always-saved-the-mandatory-set-s0"
    )
    assert _anchor("`max_set_size` on the small MoE") == "max_set_size-on-the-small-moe"


def test_the_readme_stays_short() -> None:
    # Depth belongs in docs/: the README is what a user reads first (issue 30).
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t).resolve() for t in _links(ROOT / "README.md")}
    assert set(PAGES[1:]) <= linked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    links = _links(page)
    for link in links:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_file(), f"{page.name}: {link} names no file"
        if anchor:
            assert anchor in _anchors(target), f"{page.name}: {link} names no heading"
