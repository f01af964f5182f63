"""services.allocator: the process-wide malloc tuning only ever raises its thresholds."""

from services import allocator


def test_tune_only_raises(monkeypatch):
    calls = []

    class FakeLibc:  # records mallopt instead of changing this test process's allocator
        def mallopt(self, option, value):
            calls.append((option, value))
            return 1

    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.setattr(allocator, "_applied", (0, 0))
    assert allocator.tune(64 << 20, 256 << 20)  # a server
    assert calls == [(-3, 64 << 20), (-1, 256 << 20)]
    assert not allocator.tune(4 << 20, 32 << 20)  # a client in the same process: no change
    assert allocator.tune(4 << 20, 512 << 20)  # only the trim threshold grows
    assert calls[-2:] == [(-3, 64 << 20), (-1, 512 << 20)]
    assert allocator._applied == (64 << 20, 512 << 20)
