"""A model worker's side of broker mode. ``python -m app.broker.worker`` (``__main__``) starts
one process per device slot and keeps them running (``supervisor``, with the host's
``probes``), importing no torch itself. Each process (``process``) holds its model versions
(``versions``; new ones load beside them: ``loading``), consumes their streams (``consumer``,
one read ahead: ``readahead``), answers (``replies``), takes over what dead workers left
(``orphans``), tells Redis it lives (``health``), counts what it ran (``stats``) and traces its
batches (``spans``)."""
