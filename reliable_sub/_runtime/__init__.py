"""The Subscriber's machinery for one run, inside one event loop (internal).

One job per module; each takes the parts and callbacks it needs, never the run that wires them:

* :mod:`~reliable_sub._runtime.pipeline` -- builds the stages and lanes of one run and wires them;
  lets a delivery go once its settle is confirmed.
* :mod:`~reliable_sub._runtime.receiver` -- receiving and admission: receive, lease, claim a batch.
* :mod:`~reliable_sub._runtime.dispatcher` -- ordering keys, a task per delivery, worker threads,
  the middleware chain or the direct handler call; :mod:`~reliable_sub._runtime.batches` -- a
  batch handler's batches, a task and a call each (:mod:`~reliable_sub._runtime.batch_calls`
  the call, :mod:`~reliable_sub._runtime.bisection` a failed call's messages called again in
  halves); :mod:`~reliable_sub._runtime.current` -- :func:`current_claim`.
* :mod:`~reliable_sub._runtime.decisions` -- what an outcome does to the lease, claim and settle.
* :mod:`~reliable_sub._runtime.settler` -- batched, confirmed acks and nacks, store writes first.
* :mod:`~reliable_sub._runtime.lease` -- the lease manager (p99 extensions);
  :mod:`~reliable_sub._runtime.claim_renewal` the claim renewals beside its tick,
  :mod:`~reliable_sub._runtime.lease_basics` when a lease or claim falls due and the counters,
  :mod:`~reliable_sub._runtime.histogram` its sliding histogram.
* :mod:`~reliable_sub._runtime.claims` -- the one owner of the claim lifecycle.
* :mod:`~reliable_sub._runtime.shutdown` -- the graceful (or forced) stop.
* :mod:`~reliable_sub._runtime.inflight` -- one delivery's record, shared by every stage;
  :mod:`~reliable_sub._runtime.lanes` -- Config, Route, Lane and the run's switches.
* :mod:`~reliable_sub._runtime.flow` -- flow control; :mod:`~reliable_sub._runtime.workers` --
  threads for sync handlers; :mod:`~reliable_sub._runtime.supervisor` -- restarts loops that
  fail; :mod:`~reliable_sub._runtime.watchdog` -- warns when the event loop is blocked.

Public names from here are re-exported by :mod:`reliable_sub` (``LeaseManager``,
``current_claim``); the rest may change without notice.
"""
