"""The workers' opt-in call trace: off it records nothing, on it keeps each call's parts in order."""

from ddtree_serve.serve.call_trace import CallTrace, mark


def test_an_off_trace_records_nothing() -> None:
    trace = CallTrace()
    with trace.call("draft") as stamps:
        mark(stamps, "model")
    assert stamps is None
    assert trace.take() == []


def test_an_on_trace_keeps_each_calls_parts_in_order_until_taken() -> None:
    trace = CallTrace()
    trace.enabled = True
    for method in ("draft", "verify_and_commit"):
        with trace.call(method) as stamps:
            mark(stamps, "unwire")
            mark(stamps, "model")
    calls = trace.take()
    assert [c.method for c in calls] == ["draft", "verify_and_commit"]
    for call in calls:
        assert [part for part, _ in call.marks] == ["unwire", "model", "return"]
        stamps = [call.start_s] + [at for _, at in call.marks]
        assert stamps == sorted(stamps)
    assert calls[0].marks[-1][1] <= calls[1].start_s
    assert trace.take() == []
