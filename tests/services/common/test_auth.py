"""Where tokens come from: a file or the environment, never silently nothing."""

import pytest

from services.common.auth import TOKEN_ENV, TokenError, bearer_metadata, read_token


def test_a_token_file_wins_over_the_environment_and_is_stripped(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    token_file = tmp_path / "token"
    token_file.write_text("  from-file\n")
    assert read_token(token_file) == "from-file"
    assert read_token() == "from-env"
    monkeypatch.delenv(TOKEN_ENV)
    assert read_token() is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("\n", "`--token-file` must hold a non-empty token; received an empty file"),
        ("two words", "`--token-file` must hold a token of printable ASCII without spaces"),
        ("caf\u00e9", "`--token-file` must hold a token of printable ASCII without spaces"),
    ],
)
def test_unusable_token_files_are_refused(tmp_path, content, message):
    token_file = tmp_path / "token"
    token_file.write_text(content, encoding="utf-8")
    with pytest.raises(TokenError) as caught:
        read_token(token_file)
    assert str(caught.value).startswith(message)


def test_a_missing_token_file_is_refused(tmp_path):
    with pytest.raises(TokenError, match="^`--token-file` must be a readable file"):
        read_token(tmp_path / "absent")


def test_bearer_metadata():
    assert bearer_metadata(None) == ()
    assert bearer_metadata("abc") == (("authorization", "Bearer abc"),)
