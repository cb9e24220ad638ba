from prometheus_client import CollectorRegistry, Counter, Histogram

from sluice.base.metrics import Deferred, observe_many


def test_observe_many_equals_observing_one_by_one():
    values = [0.0005, 0.001, 0.003, 0.01, 0.01, 0.7, 5.0, 1e6]
    one, many = (Histogram(name, "x", buckets=(0.001, 0.01, 1.0), registry=CollectorRegistry())
                 for name in ("one", "many"))
    for v in values:
        one.observe(v)
    observe_many(many, values)

    def samples(h):
        return {(s.name.split("_", 1)[1], tuple(s.labels.items())): s.value for s in h.collect()[0].samples
                if not s.name.endswith("_created")}

    assert samples(one) == samples(many)


def test_deferred_updates_equal_the_direct_ones_once_flushed():
    registry = CollectorRegistry()
    direct = (Histogram("d_seconds", "x", buckets=(0.01, 1.0), registry=registry),
              Counter("d_done", "x", ["reason"], registry=registry), Counter("d_tokens", "x", registry=registry))
    later = (Histogram("l_seconds", "x", buckets=(0.01, 1.0), registry=registry),
             Counter("l_done", "x", ["reason"], registry=registry), Counter("l_tokens", "x", registry=registry))
    deferred = Deferred()
    for seconds, reason, tokens in [(0.002, "stop", 5), (0.5, "length", 7), (3.0, "stop", 1)]:
        direct[0].observe(seconds)
        direct[1].labels(reason).inc()
        direct[2].inc(tokens)
        deferred.observe(later[0], seconds)
        deferred.inc(later[1], 1, reason)
        deferred.inc(later[2], tokens)

    def samples(prefix):
        return {(s.name.split("_", 1)[1], tuple(s.labels.items())): s.value for m in registry.collect()
                if m.name.startswith(prefix) for s in m.samples if not s.name.endswith("_created")}

    assert samples("l_") == {k: 0.0 for k in samples("l_")}  # nothing written before the flush
    deferred.flush(1.0)
    assert samples("l_") == samples("d_") and deferred.at == 1.0
    deferred.flush(2.0)  # (a second flush writes nothing again)
    assert samples("l_") == samples("d_")
