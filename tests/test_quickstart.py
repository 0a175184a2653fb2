"""The main job runs end to end (small setting) and shows identical tokens and hits."""

import importlib.util
import pathlib

import pytest

QUICKSTART = pathlib.Path(__file__).parent.parent / "examples" / "quickstart.py"


def test_quickstart_small_setting(capsys, family):
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    result = quickstart.main(["--family", family, "--system-tokens", "300", "--questions", "3", "--new-tokens", "8"])
    rows = result["rows"]
    assert all(r["identical"] for r in rows)
    assert rows[0]["hit"] == 0
    assert all(r["hit"] >= 288 for r in rows[1:])
    out = capsys.readouterr().out
    assert "TTFT no cache" in out and "token hit rate" in out


def test_an_unknown_family_is_an_argparse_error_listing_the_families(capsys):
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    with pytest.raises(SystemExit) as exit_info:
        quickstart.main(["--family", "mamba"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --family: invalid choice: 'mamba'" in err and "jamba" in err and "zamba2" in err
