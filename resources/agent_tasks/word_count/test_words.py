from words import word_counts


def test_case_and_punctuation():
    assert word_counts("Hello hello! World, world.") == {"hello": 2, "world": 2}


def test_empty():
    assert word_counts("") == {}
