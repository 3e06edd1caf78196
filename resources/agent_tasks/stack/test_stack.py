from stack import Stack


def test_push_peek_pop():
    s = Stack()
    assert s.is_empty()
    s.push(1)
    s.push(2)
    assert s.peek() == 2
    assert s.pop() == 2
    assert s.pop() == 1
    assert s.is_empty()


def test_pop_empty_raises():
    try:
        Stack().pop()
    except IndexError:
        return
    raise AssertionError("pop() on an empty stack must raise IndexError")
