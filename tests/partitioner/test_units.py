"""Sizes and rates: "16GiB", "50GB/s", and the errors for sizes that make no sense."""

from __future__ import annotations

import pytest

from partitioner.errors import InputError
from partitioner.units import format_bytes, format_flops, format_seconds, parse_bytes, parse_rate


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("16GiB", 16 * 2**30),
        ("16GB", 16 * 10**9),
        ("40 GB", 40 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5KiB", 1536),
        ("2kb", 2000),
        ("1TiB", 2**40),
        ("100", 100),
        ("100B", 100),
        ("1e3", 1000),
        (4096, 4096),
        (1.5e9, 1_500_000_000),
        (2.6, 3),
    ],
)
def test_parse_bytes_accepts_numbers_and_units(value, expected):
    result = parse_bytes(value)
    assert result == expected
    assert isinstance(result, int)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("-3", r"'-3' is not a size.*'16GiB'"),
        ("0", "must be positive"),
        (0, "must be positive"),
        (-3, "must be positive"),
        (float("inf"), "must be positive and finite"),
        (float("nan"), "must be positive and finite"),
        ("abc", "'abc' is not a size"),
        ("16XB", "'16XB' is not a size"),
        ("", "is not a size"),
        (0.4, "at least one byte"),
        (True, "must be a number of bytes.*Received: True"),
        (None, "must be a number of bytes.*Received: None"),
        ([16], "must be a number of bytes"),
    ],
)
def test_parse_bytes_rejects_nonsense_by_message(value, match):
    with pytest.raises(InputError, match=match):
        parse_bytes(value)


def test_parse_bytes_names_the_value_in_the_message():
    with pytest.raises(InputError, match=r"memory of device '/GPU:0'"):
        parse_bytes("-3", name="memory of device '/GPU:0'")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("50GB/s", 50e9),
        ("50 GB/s", 50e9),
        ("900GiB/s", 900 * 2**30),
        ("1.5e12", 1.5e12),
        ("2.5", 2.5),  # a rate is not rounded to whole bytes
        (450e9, 450e9),
        (3, 3.0),
    ],
)
def test_parse_rate_accepts_numbers_and_units(value, expected):
    result = parse_rate(value)
    assert result == expected
    assert isinstance(result, float)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("-1GB/s", "is not a size"),
        ("0GB/s", "must be positive"),
        ("fast", "'fast' is not a size"),
        ("/s", "is not a size"),
        (0, "must be positive and finite"),
        (-5.0, "must be positive and finite"),
        (float("inf"), "must be positive and finite"),
        (True, "must be a number of FLOP/s.*Received: True"),
        (None, "must be a number of FLOP/s.*Received: None"),
    ],
)
def test_parse_rate_rejects_nonsense_by_message(value, match):
    with pytest.raises(InputError, match=match):
        parse_rate(value, unit="FLOP/s")


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1536, "1.5 KiB"),
        (3 * 2**20, "3.0 MiB"),
        (16 * 2**30, "16.0 GiB"),
        (2**50, "1024.0 TiB"),
    ],
)
def test_format_bytes_uses_binary_units(num_bytes, text):
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(2.5, "2.50 s"), (1.0, "1.00 s"), (0.0123, "12.30 ms"), (1e-3, "1.00 ms"), (2.5e-5, "25.0 µs"), (0.0, "0.0 µs")],
)
def test_format_seconds_picks_a_readable_unit(seconds, text):
    assert format_seconds(seconds) == text


@pytest.mark.parametrize(
    ("flops", "text"),
    [(2.5e9, "2.50 G"), (1e15, "1.00 P"), (3.2e12, "3.20 T"), (4e6, "4.00 M"), (1500, "1.50 K"), (12, "12")],
)
def test_format_flops_uses_si_prefixes(flops, text):
    assert format_flops(flops) == text


def test_format_bytes_round_trips_through_parse_bytes():
    assert parse_bytes(format_bytes(16 * 2**30).replace(" ", "")) == 16 * 2**30
