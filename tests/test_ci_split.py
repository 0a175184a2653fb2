"""Every test module is classified for CI's passes on the older releases of the tested window
(hf_hybridcache/_compat/versions.py), which run the version-specific ones only (tests/conftest.py), so a new module
cannot silently drop out of them."""

from pathlib import Path

from conftest import VERSION_INDEPENDENT_MODULES, VERSION_SPECIFIC_MODULES


def test_every_test_module_is_classified_once():
    modules = {p.stem for p in Path(__file__).parent.glob("test_*.py")}
    assert not VERSION_SPECIFIC_MODULES & VERSION_INDEPENDENT_MODULES
    listed = VERSION_SPECIFIC_MODULES | VERSION_INDEPENDENT_MODULES
    assert modules == listed, f"classify in conftest: new {sorted(modules - listed)}, gone {sorted(listed - modules)}"
