import threading
import time

from master.sharding.streams import StreamRegistry


def test_wait_closed_returns_when_the_last_stream_ends():
    reg = StreamRegistry()
    assert reg.wait_closed(1, 0.01)  # nothing open
    reg.opened(1)
    reg.opened(1)
    assert not reg.wait_closed(1, 0.05)
    threading.Timer(0.1, reg.closed, args=(1,)).start()
    threading.Timer(0.2, reg.closed, args=(1,)).start()
    t0 = time.monotonic()
    assert reg.wait_closed(1, 5)
    assert 0.15 < time.monotonic() - t0 < 2
    assert not reg.is_open(1)
