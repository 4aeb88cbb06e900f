"""Which client address failed authentications count against (api/auth_throttle.py)."""

from __future__ import annotations

from starlette.requests import Request

from api.auth_throttle import client_address


def _request_from(host: str) -> Request:
    return Request({"type": "http", "client": (host, 4242), "headers": []})


def test_an_ipv6_client_counts_as_its_slash_64():
    one, same_host = _request_from("2001:db8::1"), _request_from("2001:db8::ffff:2")
    assert client_address(one) == client_address(same_host) == "2001:db8::/64"
    assert client_address(_request_from("2001:db8:0:1::1")) == "2001:db8:0:1::/64"
    assert client_address(_request_from("::ffff:192.0.2.1")) == "192.0.2.1"
    assert client_address(_request_from("192.0.2.1")) == "192.0.2.1"
