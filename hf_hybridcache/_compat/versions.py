"""The transformers releases hf_hybridcache is tested on: the one place that pyproject's requirement, the runtime check
(:func:`hf_hybridcache._compat.check_version`), CI (``.ci/run``) and the docs agree with (tests/test_version_window.py
keeps them equal).

Why this window. transformers ships a minor release every one to two weeks, and most of them move an internal this
package reaches into (cache layers, ``generate()``'s prefill, mixer kernels, continuous batching). The window is the
last three minors: users pinned one or two releases back keep working, and CI (the whole suite on the newest, the
version-specific tests on the two before it) stays under an hour. The ceiling is the newest release the whole suite
has passed, so that ``pip install`` never picks an untested one; a version outside the window is refused when a cache
is built, unless :data:`ALLOW_UNTESTED_ENV` is set.

Raising the ceiling (docs/usage.md, "The supported transformers window"): install the new release, run
tests/test_hook_points.py first (it names each internal that moved), then the whole suite; then add the release to
:data:`TESTED_RELEASES` here and drop the oldest, and update pyproject.toml and the docs the test names.

This file imports nothing, so CI's shell script reads it by path (``runpy.run_path``) without importing transformers.
"""

#: The transformers releases the suite runs on, oldest first. CI runs the whole suite on the newest (what a fresh
#: ``pip install`` picks) and the version-specific tests (``pytest -m transformers_version``) on the others.
TESTED_RELEASES = ("5.23.0", "5.24.0", "5.25.0")
OLDEST, NEWEST = TESTED_RELEASES[0], TESTED_RELEASES[-1]
#: The releases CI runs only the version-specific tests on.
OLDER = TESTED_RELEASES[:-1]
#: The releases as a sentence names them ("5.23.0, 5.24.0 and 5.25.0").
IN_WORDS = f"{', '.join(TESTED_RELEASES[:-1])} and {NEWEST}"
#: The requirement pyproject.toml declares; the runtime check accepts exactly the versions it allows.
REQUIREMENT = f"transformers>={OLDEST},<={NEWEST}"
#: The command that installs a tested transformers.
INSTALL_COMMAND = f"pip install '{REQUIREMENT}'"
#: Set to 1 to run hf_hybridcache on a transformers outside the window (warned once per process).
ALLOW_UNTESTED_ENV = "HF_HYBRIDCACHE_ALLOW_UNTESTED_TRANSFORMERS"
