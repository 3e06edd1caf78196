"""Statistics helpers."""


def median(values):
    values.sort()
    return values[len(values) // 2]
