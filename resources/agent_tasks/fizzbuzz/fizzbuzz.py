"""FizzBuzz."""


def fizzbuzz(n):
    raise NotImplementedError("write me")
