"""The per-file runner of `make test`: every file in its own pytest, a failing or crashing
file named in the summary and the exit status, a wrong path refused by name."""

import pytest

from tests.support import isolated


def test_a_crashing_file_is_named_and_fails_the_run_while_the_others_pass(tmp_path, capsys):
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    assert True\n")
    (tmp_path / "test_crash.py").write_text(
        "import ctypes\n\ndef test_crash():\n    ctypes.string_at(0)\n"
    )
    status = isolated.main(
        ["--jobs", "2", "--pytest-arg=-p", "--pytest-arg=no:cacheprovider", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert status == 1
    assert "== 1 of 2 files passed" in out
    assert f"FAILED FILE {tmp_path / 'test_crash.py'} (exit -11)" in out
    assert f"== {tmp_path / 'test_fine.py'} (exit 0" in out


def test_a_missing_path_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="`PATH` must be a test file or directory"):
        isolated.main([str(tmp_path / "nowhere")])
