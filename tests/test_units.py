import pytest

from waste.errors import WasteError
from waste.units import human_bytes, human_count, parse_count, parse_size


@pytest.mark.parametrize(("text", "n"), [("4096", 4096), ("4K", 4096), ("128k", 131072), ("1M", 1048576)])
def test_parse_count(text, n):
    assert parse_count(text) == n
    assert human_count(n) == (text.upper() if not text.isdigit() else "4K")


def test_parse_count_is_exact():
    # through a float, 10**26 came back as 100000000000000004764729344
    assert parse_count("9" * 26) == int("9" * 26) and parse_count("1.5K") == 1536
    assert parse_size("9" * 26) == int("9" * 26)


@pytest.mark.parametrize("text", ["", "4KB", "-1", "1.5", "lots", "\uff14K", "\u00b2", "1.0001K"])
def test_parse_count_refuses(text):
    with pytest.raises(WasteError):
        parse_count(text)


def test_sizes():
    assert parse_size("24G") == parse_size("24GiB") == 24 << 30
    assert parse_size("512M") == 512 << 20 and parse_size("100") == 100
    assert human_bytes(434110464) == "414 MiB" and human_bytes(30523392) == "29.1 MiB"
    assert human_bytes(1010 << 20) == "1010 MiB" and human_bytes(1023 << 20) == "1023 MiB"
    assert human_bytes(999.4 * (1 << 20)) == "999 MiB" and human_bytes(1 << 30) == "1 GiB"
    # what would round to 1024 of a unit is 1 of the next
    assert human_bytes((1 << 20) - 1) == "1 MiB" and human_bytes(1023.7 * (1 << 30)) == "1 TiB"
    assert human_bytes(1023.4 * 1024) == "1023 KiB" and human_bytes(1536 << 20) == "1.5 GiB"
    with pytest.raises(WasteError):
        parse_size("big")
    # A fraction needs a unit: "1.5" is not one byte
    assert parse_size("1.5G") == 3 << 29 and parse_size("100.0") == 100
    with pytest.raises(WasteError, match="a fraction of a byte; give a unit, such as 1.5G"):
        parse_size("1.5")


def test_terabytes():
    assert parse_size("2T") == parse_size("2TiB") == 2 << 40
