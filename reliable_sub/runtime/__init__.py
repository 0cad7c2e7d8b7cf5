"""The Subscriber's machinery for one run, inside one event loop (internal).

* :mod:`~reliable_sub.runtime.pipeline` -- the path of one delivery, top to bottom: receive,
  claim, dispatch to its own task, run the middleware chain and handler, decide, settle; and
  the stop.
* :mod:`~reliable_sub.runtime.inflight` -- one delivery's record, shared by the parts below.
* :mod:`~reliable_sub.runtime.lease` -- the lease manager (p99 extensions, claim renewals);
  :mod:`~reliable_sub.runtime.histogram` its sliding histogram.
* :mod:`~reliable_sub.runtime.settler` -- batched, confirmed acks and nacks, store writes first.
* :mod:`~reliable_sub.runtime.flow` -- flow control; :mod:`~reliable_sub.runtime.workers` --
  threads for sync handlers; :mod:`~reliable_sub.runtime.supervisor` -- restarts loops that
  fail; :mod:`~reliable_sub.runtime.watchdog` -- warns when the event loop is blocked.

Public names from here are re-exported by :mod:`reliable_sub` (``LeaseManager``,
``current_claim``); the rest may change without notice.
"""
