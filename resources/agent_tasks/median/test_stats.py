from stats import median


def test_odd():
    assert median([3, 1, 2]) == 2


def test_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_input_unchanged():
    data = [3, 1, 2]
    median(data)
    assert data == [3, 1, 2]
