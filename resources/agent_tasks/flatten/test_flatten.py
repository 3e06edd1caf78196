from flatten import flatten


def test_one_level():
    assert flatten([1, [2, 3], 4]) == [1, 2, 3, 4]


def test_deep_and_tuples():
    assert flatten([1, [2, [3, (4, [5])]], []]) == [1, 2, 3, 4, 5]
