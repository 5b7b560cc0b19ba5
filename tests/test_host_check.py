"""worker/http/host_check.py: which Host names the HTTP front answers (DNS rebinding), by bind address and flag."""

from __future__ import annotations

import pytest

from radixcache.worker.http.host_check import allowed_hosts, host_allowed, host_name


@pytest.mark.parametrize(
    ("header", "name"),
    [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"), ("Example.COM.:80", "example.com"),
     ("10.0.0.7", "10.0.0.7"), ("::1", "::1")],
)  # fmt: skip
def test_the_name_of_a_host_header(header, name):
    assert host_name(header) == name


def test_bound_to_loopback_only_loopback_names_and_ip_literals_are_answered():
    allowed = allowed_hosts("127.0.0.1")
    for header in ("localhost:8000", "LOCALHOST", "app.localhost", "127.0.0.1:8000", "[::1]:8000", "10.1.2.3", None):
        assert host_allowed(header, allowed), header
    for header in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io", ""):
        assert not host_allowed(header, allowed), header
    assert allowed_hosts("::1") == allowed and allowed_hosts("localhost") == allowed


def test_beyond_loopback_any_host_unless_names_are_given():
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("10.0.0.5") is None
    named = allowed_hosts("0.0.0.0", ["api.example.com", " Other.Example. "])
    assert host_allowed("api.example.com:443", named) and host_allowed("other.example", named)
    assert host_allowed("localhost", named) and not host_allowed("evil.example", named)
    assert allowed_hosts("127.0.0.1", ["*"]) is None
