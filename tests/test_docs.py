"""The README stays true to the code."""

from pathlib import Path

from dtrain.config import reference_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_readme_config_reference_matches_the_dataclasses():
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    table = readme[readme.index(start) + len(start):readme.index(end)].strip()
    assert table == reference_markdown(), "regenerate with: dtrain config --config tiny --reference"


def test_readme_names_every_config_file():
    readme = (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "configs").glob("*.toml")):
        assert path.stem in readme, f"configs/{path.name} is not mentioned in README.md"
