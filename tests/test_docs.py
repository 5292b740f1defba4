"""The documentation site (``mkdocs.yml``, ``docs/``) builds strict, and its validation turns
each defect it guards against into a failed build: a broken link, a broken anchor, a page
left out of the nav and a nav entry to no file (mkdocs alone only notes some of them)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"
DOCS = ROOT / "docs"


def build_site(docs_dir: Path, site_dir: Path) -> None:
    """Build the site of ``mkdocs.yml`` from ``docs_dir`` into ``site_dir``, strict.

    Raises:
        Abort: a warning in strict mode (the warnings are logged on ``mkdocs``).
    """
    config = load_config(
        config_file=str(CONFIG), docs_dir=str(docs_dir), site_dir=str(site_dir), strict=True
    )
    build(config)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def _quiet_theme(monkeypatch: pytest.MonkeyPatch) -> None:
    # The material theme prints an end-of-life banner on every build unless told not to.
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")


class TestSite:
    def test_the_site_builds_strict(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.WARNING, logger="mkdocs")
        build_site(DOCS, tmp_path / "site")
        assert warnings_of(caplog) == []
        assert (tmp_path / "site" / "index.html").is_file()

    def test_the_config_is_strict_and_validates_links_anchors_and_the_nav(self) -> None:
        config = load_config(config_file=str(CONFIG))
        assert config.strict is True
        validation = config.validation
        for check in ("omitted_files", "not_found", "absolute_links"):
            assert validation.nav[check] == logging.WARNING, f"nav.{check}"
        for check in ("not_found", "anchors", "absolute_links", "unrecognized_links"):
            assert validation.links[check] == logging.WARNING, f"links.{check}"


def _append(page: str, text: str) -> Callable[[Path], None]:
    def inject(docs: Path) -> None:
        path = docs / page
        path.write_text(path.read_text(encoding="utf-8") + "\n" + text + "\n", encoding="utf-8")

    return inject


def _orphan(docs: Path) -> None:
    (docs / "orphan.md").write_text("# A page no nav entry names\n", encoding="utf-8")


def _missing(docs: Path) -> None:
    (docs / "cluster-design.md").unlink()


#: One defect each, injected into a copy of docs/, and what the build must say about it.
DEFECTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "broken link": (
        _append("index.md", "[gone](no-such-page.md)"),
        "contains a link 'no-such-page.md', but the target is not found",
    ),
    "broken anchor": (
        _append("index.md", "[gone](cluster-design.md#no-such-heading)"),
        "does not contain an anchor '#no-such-heading'",
    ),
    "broken anchor on the same page": (
        _append("index.md", "[gone](#no-such-heading)"),
        "there is no such anchor on this page",
    ),
    "orphan page": (_orphan, "orphan.md"),
    "missing page": (_missing, "'cluster-design.md' is included in the 'nav' configuration"),
}


class TestValidation:
    @pytest.mark.parametrize("defect", sorted(DEFECTS))
    def test_each_defect_fails_the_build(
        self, defect: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        inject, said = DEFECTS[defect]
        docs = tmp_path / "docs"
        shutil.copytree(DOCS, docs)
        inject(docs)
        caplog.set_level(logging.WARNING, logger="mkdocs")
        with pytest.raises(Abort, match="strict mode"):
            build_site(docs, tmp_path / "site")
        found = warnings_of(caplog)
        assert any(said in w for w in found), found
