import pytest

from autotune.common.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, value", [("12GiB", 12 * 2**30), ("512 MB", 512 * 10**6), ("1.5g", 1_500_000_000),
                                         ("2048", 2048), ("0.5 TiB", 2**39), ("64kib", 65536)])
def test_sizes_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1GB", "12 parsecs", "1e"])
def test_bad_sizes_name_the_text(text):
    with pytest.raises(ValueError, match=repr(text).replace("(", r"\(")):
        parse_bytes(text)


def test_format_round_trip():
    assert format_bytes(parse_bytes("1.5GiB")) == "1.5 GiB"
