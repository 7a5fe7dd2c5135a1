from __future__ import annotations

import pytest

from ckptfix.core.errors import UsageError
from ckptfix.core.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5 * 10**9),
        ("5GiB", 5 * 2**30),
        ("123", 123),
        ("1KB", 1000),
        ("10kB", 10_000),  # the SI symbol
        ("1KiB", 1024),
        ("2MB", 2 * 10**6),
        ("3MiB", 3 * 2**20),
        ("1TB", 10**12),
        ("1TiB", 2**40),
        ("1.5GB", 1_500_000_000),
        ("500MB", 500_000_000),
        ("7B", 7),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["5G", "5gb", "5Gb", "-1", "0", "", "GB", "1.5", "1e9", "5 GB x", "0.5B", "5PB", "1,000"],
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_size(text)
    assert caught.value.exit_code == 2
    assert repr(text) in caught.value.line()


def test_format_size() -> None:
    assert format_size(999) == "999 B"
    assert format_size(4_976_698_672) == "4.98 GB"
