from prometheus_client import CollectorRegistry, Histogram

from sluice.metrics import observe_many


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
