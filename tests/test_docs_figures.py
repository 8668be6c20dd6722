"""The docs' figures (issue 75): drawn by `make docs-figures` (scripts/docs_figures.py) from
bench/results, each recording the sha256 of the results file it was drawn from, so a figure left
behind by newer measurements fails here; each shown on a docs page."""

from __future__ import annotations

import importlib.util

from PIL import Image

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "scripts" / "docs_figures.py")
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)
FOLDER = ROOT / "docs" / "figures"


def test_every_figure_is_drawn_from_its_results_as_they_are_now():
    for name, (results, _) in figures.FIGURES.items():
        with Image.open(FOLDER / name) as image:
            drawn_from = image.text.get("Source")
        now = figures.source_tag(figures.RESULTS / results)
        assert drawn_from == now, f"{name} is older than {results}: run `make docs-figures`"


def test_every_figure_is_on_a_docs_page():
    pages = "".join(page.read_text() for page in (ROOT / "docs").glob("*.md"))
    for name in figures.FIGURES:
        assert f"](figures/{name})" in pages, name
    assert sorted(p.name for p in FOLDER.glob("*.png")) == sorted(figures.FIGURES)  # no orphan


def test_the_script_draws_every_figure(tmp_path):
    figures.main(["--out", str(tmp_path)])
    for name in figures.FIGURES:
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG" and image.width >= 600
            assert image.text["Source"].startswith(f"bench/results/{figures.FIGURES[name][0]} ")
