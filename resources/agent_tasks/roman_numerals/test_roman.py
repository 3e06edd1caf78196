from roman import to_roman


def test_simple():
    assert to_roman(3) == "III"
    assert to_roman(8) == "VIII"


def test_subtractive():
    assert to_roman(4) == "IV"
    assert to_roman(9) == "IX"
    assert to_roman(14) == "XIV"
    assert to_roman(1994) == "MCMXCIV"
