"""The tested transformers window has one source, hf_hybridcache/_compat/versions.py, and pyproject.toml's requirement,
the runtime check, CI (.ci/run) and the docs state the same window.

Raising the ceiling is one edit of that file; each test here then names a place that must follow (docs/usage.md, "The
supported transformers window")."""

import re
import runpy
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from hf_hybridcache import _compat

ROOT = Path(__file__).parent.parent
#: The window as CI reads it: by path, without importing the package or transformers.
WINDOW = runpy.run_path(str(ROOT / "hf_hybridcache" / "_compat" / "versions.py"))
RELEASES = WINDOW["TESTED_RELEASES"]
NEWEST, OLDER, IN_WORDS = WINDOW["NEWEST"], WINDOW["OLDER"], WINDOW["IN_WORDS"]
#: Every page that may state the window.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _minor(version: str) -> tuple[int, int]:
    return Version(version).release[:2]


def test_the_window_is_the_last_three_minors_with_the_newest_last():
    assert len(RELEASES) == 3 and list(RELEASES) == sorted(RELEASES, key=Version) and NEWEST == RELEASES[-1]
    assert not any(Version(r).is_prerelease for r in RELEASES), RELEASES  # a patch release may stand for its minor
    majors, minors = zip(*map(_minor, RELEASES))
    assert len(set(majors)) == 1 and list(minors) == list(range(minors[0], minors[0] + 3)), RELEASES
    assert list(OLDER) == list(RELEASES[:-1])
    assert WINDOW["REQUIREMENT"] == f"transformers>={RELEASES[0]},<={NEWEST}"
    assert WINDOW["INSTALL_COMMAND"] == f"pip install '{WINDOW['REQUIREMENT']}'"


def test_pyproject_requires_the_window():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    transformers = [d for d in dependencies if Requirement(d).name == "transformers"]
    assert transformers == [WINDOW["REQUIREMENT"]]


def test_the_runtime_check_accepts_what_pip_would_install():
    assert _compat.TESTED_RELEASES == RELEASES
    assert _compat.SUPPORTED == Requirement(WINDOW["REQUIREMENT"]).specifier
    accepted = [v for v in ("5.22.0", *RELEASES, "5.24.1", f"{_minor(NEWEST)[0]}.{_minor(NEWEST)[1] + 1}.0.dev0",
                            f"{_minor(NEWEST)[0]}.{_minor(NEWEST)[1] + 1}.0") if _compat.SUPPORTED.contains(v)]
    assert accepted == [*RELEASES, "5.24.1"]


def test_ci_reads_the_window_from_its_source_and_pins_no_transformers_by_hand():
    script = (ROOT / ".ci" / "run").read_text()
    assert "hf_hybridcache/_compat/versions.py" in script
    pinned = [line for line in script.splitlines() if "transformers" in line and re.search(r"\d+\.\d+", line)]
    assert not pinned, f".ci/run names transformers versions itself: {pinned}"
    window = re.search(r"^window\(\) \{\n.*?^\}\n", script, re.S | re.M).group(0)
    read = subprocess.run(["bash", "-c", f'{window}window REQUIREMENT; window NEWEST; window OLDER'], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert read == [WINDOW["REQUIREMENT"], NEWEST, " ".join(OLDER)]
    assert 'python -m pytest -q -n 2\n' in script  # the whole suite, on what the README's install line picks
    assert 'for RELEASE in $OLDER; do' in script and '-m pytest -q -n 2 -m transformers_version' in script


def test_the_readme_states_the_window():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"Every family is tested on transformers {IN_WORDS}" in readme
    assert (f"runs the whole suite on transformers {NEWEST} (what the install line picks) and the version-specific "
            f"tests (`-m transformers_version`) on {' and '.join(OLDER)}.") in readme


def test_the_docs_state_the_window():
    usage = " ".join((ROOT / "docs" / "usage.md").read_text().split())
    assert f"hf_hybridcache is tested with transformers {IN_WORDS}, and its requirement is `{WINDOW['REQUIREMENT']}`" \
        in usage
    assert f"{WINDOW['ALLOW_UNTESTED_ENV']}=1" in usage and WINDOW["INSTALL_COMMAND"] in usage
    models = " ".join((ROOT / "docs" / "models.md").read_text().split())
    assert (f"CI runs the whole suite on transformers {NEWEST} and the version-specific tests on "
            f"{' and '.join(OLDER)}") in models


def test_each_family_row_names_the_releases_it_is_tested_on():
    """docs/models.md's "tested with" column: every release of the window from the one that added the family."""
    rows = [line for line in (ROOT / "docs" / "models.md").read_text().splitlines()
            if line.startswith("| ") and "| transformers " in line]
    assert rows
    for row in rows:
        cell = row.rstrip(" |").rsplit("| transformers ", 1)[1]
        listed = re.findall(r"\d+\.\d+\.\d+", cell.split(" (")[0])
        assert listed == list(RELEASES[len(RELEASES) - len(listed):]) and listed, row


def test_no_page_claims_tests_on_a_version_outside_the_window():
    minors = {_minor(r) for r in RELEASES}
    for page in PAGES:
        text = " ".join(page.read_text().split())
        for claim in re.finditer(r"tested (?:on|with) transformers ((?:\d+\.\d+(?:\.\d+)?(?:,? (?:and )?| )?)+)", text):
            outside = [v for v in re.findall(r"\d+\.\d+(?:\.\d+)?", claim.group(1)) if _minor(v) not in minors]
            assert not outside, f"{page.name}: {claim.group(0)!r} names {outside}, outside the window {RELEASES}"
