

def test_the_choices_a_runtime_may_send_are_those_asked_for():
    """Pure: a choice index is below n (times the prompts of a legacy completions batch), never a list that long."""
    from runtime_worker.backends.base import JobError
    from runtime_worker.native_server import choice_index, requested_choices

    assert requested_choices({}) == 1 and requested_choices({"n": 3}) == 3
    assert requested_choices({"n": 2, "prompt": ["a", "b", [1, 2]]}, completions=True) == 6
    assert requested_choices({"n": 2, "prompt": [1, 2, 3]}, completions=True) == 2  # one prompt of tokens
    assert requested_choices({"n": 128, "prompt": ["a"] * 100}, completions=True) == 2048  # the ceiling
    assert requested_choices({"n": True}) == requested_choices({"n": "9"}) == 1
    assert choice_index({"index": 2}, 3) == 2 and choice_index({}, 1) == 0
    for bad in ({"index": 3}, {"index": -1}, {"index": 20_000_000}, {"index": "0"}, {"index": 1.5}, []):
        with pytest.raises(JobError) as err:
            choice_index(bad, 3)
        assert err.value.code == "protocol_error"
