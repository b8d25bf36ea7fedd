"""Service settings as validated, frozen pydantic models: keyword construction, the rules of
ServerConfig, the retry policy's backoff, and a token that never shows in a repr."""

import pydantic
import pytest

from distill.config import ConfigError
from services.common.config import RetryPolicy, ServerConfig, is_loopback, split_address


def test_server_config_keywords_options_and_a_hidden_token():
    config = ServerConfig(address="0.0.0.0:0", token="s3cret", max_message_bytes=1024)
    assert config.token == "s3cret" and "s3cret" not in repr(config)
    assert config.channel_options == [
        ("grpc.max_receive_message_length", 1024),
        ("grpc.max_send_message_length", 1024),
    ]
    with pytest.raises(pydantic.ValidationError):
        config.grace_s = 1.0  # frozen


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"address": "[::1]"}, "`address` must be host:port with a port in [0, 65535]"),
        ({"address": "10.0.0.1:5"}, "`token` must be set when `address` is not loopback"),
        ({"token": ""}, "`token` must be non-empty or None; received ''"),
        ({"tls_key_file": "k.pem"}, "`tls_cert_file` must be given together with the other"),
        ({"max_workers": 0}, "`max_workers` must be greater than or equal to 1; received 0"),
        ({"max_message_bytes": 2.5}, "`max_message_bytes` must be a valid integer; received 2.5"),
        ({"max_workers": 300}, "`max_concurrent_rpcs` must be >= max_workers=300"),
        ({"grace_s": -1}, "`grace_s` must be greater than or equal to 0; received -1"),
        ({"port": 5}, "`port` is not a known field; received 5"),
    ],
)
def test_bad_server_configs_name_the_field(fields, message):
    with pytest.raises(ConfigError) as caught:
        ServerConfig(**fields)
    assert str(caught.value).startswith(message)


def test_addresses():
    assert split_address("[::1]:50051") == ("[::1]", 50051)
    assert is_loopback("[::1]") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("teacher.svc")


def test_retry_policy_backoff_doubles_up_to_the_cap():
    policy = RetryPolicy(retries=5, backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.delay_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.delay_s(5000) == 3.0  # no overflow however long an outage lasts


def test_the_default_retry_policy_rides_out_a_replica_restart():
    # A budget, not a count: retries go on for 30 s after the first failure (a tiny
    # teacher restarts in about 4 s), each at most 2 s after the last.
    policy = RetryPolicy()
    assert (policy.retries, policy.budget_s, policy.max_backoff_s) == (None, 30.0, 2.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"retries": -1}, "`retries` must be greater than or equal to 0; received -1"),
        ({"backoff_s": 6.0}, "`backoff_s` must be in [0, max_backoff_s=2.0]; received 6.0"),
        ({"max_backoff_s": -1.0}, "`max_backoff_s` must be greater than or equal to 0"),
        ({"budget_s": -1.0}, "`budget_s` must be greater than or equal to 0"),
        ({"retries": 1.5}, "`retries` must be a valid integer"),
    ],
)
def test_bad_retry_policies_name_the_field(fields, message):
    with pytest.raises(ConfigError) as caught:
        RetryPolicy(**fields)
    assert str(caught.value).startswith(message)
