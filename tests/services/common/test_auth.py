"""Where tokens come from: a file (private to its owner) or the environment, never silently
nothing."""

import os

import pytest

from services.common.auth import TOKEN_ENV, TokenError, bearer_metadata, read_token


def private_file(path, content, mode=0o600):
    """``content`` written to ``path`` with ``mode`` (a token file as an operator makes one)."""
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    path.chmod(mode)
    return path


def test_a_token_file_wins_over_the_environment_and_is_stripped(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    token_file = private_file(tmp_path / "token", "  from-file\n")
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
        (b"\xff\xfe", "`--token-file` must hold a token of printable ASCII without spaces"),
    ],
)
def test_unusable_token_files_are_refused(tmp_path, content, message):
    token_file = private_file(tmp_path / "token", content)
    with pytest.raises(TokenError) as caught:
        read_token(token_file)
    assert str(caught.value).startswith(message)


def test_a_missing_token_file_is_refused(tmp_path):
    with pytest.raises(TokenError, match="^`--token-file` must be a readable file"):
        read_token(tmp_path / "absent")


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
@pytest.mark.parametrize(
    ("mode", "who"),
    [(0o644, "group and others"), (0o640, "group"), (0o604, "others"), (0o620, "group")],
)
def test_a_token_file_others_can_access_is_refused_by_name(tmp_path, mode, who):
    token_file = private_file(tmp_path / "token", "s3cr3t-t0ken\n", mode)
    with pytest.raises(TokenError) as caught:
        read_token(token_file)
    assert str(caught.value) == (
        "`--token-file` must be accessible by its owner only, like an ssh key (run "
        f"`chmod 600 {token_file}`, or mount a secret with mode 0400); received "
        f"{str(token_file)!r} with mode {mode:04o}, open to {who}"
    )
    assert "s3cr3t" not in str(caught.value)


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_owner_only_token_files_are_accepted(tmp_path, mode):
    assert read_token(private_file(tmp_path / "token", "secret\n", mode)) == "secret"


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_a_symlink_is_judged_by_the_file_it_points_to(tmp_path):
    # Kubernetes mounts a secret as a symlink into a hidden directory.
    target = private_file(tmp_path / "data", "secret\n", 0o644)
    link = tmp_path / "token"
    link.symlink_to(target)
    with pytest.raises(TokenError, match="with mode 0644, open to group and others"):
        read_token(link)
    target.chmod(0o400)
    assert read_token(link) == "secret"


def test_bearer_metadata():
    assert bearer_metadata(None) == ()
    assert bearer_metadata("abc") == (("authorization", "Bearer abc"),)
