"""A ticket crosses HTTP from any client: each field is checked when it is parsed, before anything connects."""

from __future__ import annotations

import pytest

from kvlend.errors import ProtocolError
from kvlend.protocol.ticket import Ticket
from tests.support.wire import GOOD, wire_text

pytestmark = pytest.mark.unit



@pytest.mark.parametrize("host", [
    "127.0.0.1", "::1", "fe80::1%eth0", "localhost", "prefill-0.pool.example", "example.com.", "xn--bcher-kva.example",
    "a" * 63 + ".b", ".".join(["a" * 63] * 3) + "." + "a" * 61,
])
def test_ip_literals_and_dns_names_are_accepted(host):
    assert Ticket.from_text(wire_text(host=host)).host == host


@pytest.mark.parametrize("host, why", [
    ("a..b", "label ''"),
    ("", "0 characters"),
    (".", "0 characters"),
    ("-a.example", "label '-a'"),
    ("a-.example", "label 'a-'"),
    ("a" * 64 + ".example", "1..63"),
    (".".join(["a" * 63] * 4), "255 characters"),
    ("b\u00fccher.example", "not ASCII"),
    ("a b.example", "label 'a b'"),
    ("a\nb.example", "label 'a\\\\nb'"),  # escaped in the message: a log line stays one line
    ("a_b.example", "label 'a_b'"),
    ("[::1]", "label"),
    ("1.2.3.999", "never all digits"),
    ("host:80", "label 'host:80'"),
    (7, "got a int"),
])
def test_a_host_that_is_no_ip_literal_and_no_dns_name_is_refused_naming_the_field(host, why):
    with pytest.raises(ProtocolError, match=f"ticket.host: .*{why}"):
        Ticket.from_text(wire_text(host=host))
    with pytest.raises(ProtocolError, match="ticket.host"):
        Ticket(**{**GOOD, "host": host})


@pytest.mark.parametrize("field, value", [
    ("port", 0), ("port", 65536), ("port", -1), ("port", True), ("port", "80"),
    ("num_tokens", 0), ("num_tokens", 1 << 41),
    ("prefill", ""), ("prefill", 7), ("layout_id", "x" * 65), ("lease", b"\x00" * 15),
])
def test_out_of_range_fields_are_refused_naming_the_field(field, value):
    with pytest.raises(ProtocolError, match=f"ticket.{field}"):
        Ticket.from_text(wire_text(**{field: value}))
