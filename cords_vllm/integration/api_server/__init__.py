"""API-server processes: the stream API (:mod:`~.streams`) and the ``/metrics`` collector (:mod:`~.metrics`)."""
