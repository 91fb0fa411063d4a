import signal

import pytest

from master.job.faults import FaultSpecError, due, parse_fault


def test_parse_forms():
    f = parse_fault("worker:1@50%")
    assert (f.node_type, f.rank, f.at_percent, f.signal) == ("worker", 1, 50.0, signal.SIGKILL)
    assert parse_fault("ps:0@30s").at_seconds == 30.0
    assert parse_fault("chief:0@step=1000").at_step == 1000
    assert parse_fault("worker:0@10%:SIGTERM").signal == signal.SIGTERM
    assert parse_fault("worker:0@10%:TERM").signal == signal.SIGTERM


@pytest.mark.parametrize(
    "bad", ["worker@50%", "worker:1", "gpu:0@1s", "worker:0@150%", "w:0@1s:FOO"]
)
def test_bad_specs_name_the_fix(bad):
    with pytest.raises(FaultSpecError) as e:
        parse_fault(bad)
    assert bad in str(e.value)


def test_due():
    f = parse_fault("worker:1@50%")
    assert not due(f, 49.9, 100, 10**6)
    assert due(f, 50.0, 0, 0)
    assert due(parse_fault("ps:0@2s"), 0, 2.5, 0)
    assert not due(parse_fault("ps:0@step=5"), 100, 100, 4)
