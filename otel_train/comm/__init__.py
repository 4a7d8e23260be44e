"""The communication recorder: every collective and point-to-point op of this process as a ``comm.*``
span (docs/comm.md).

Rooms, one role each:

* ``notes``: the hot path's :class:`~otel_train.comm.notes.Note` and the deque it goes to;
* ``patch``: wrappers around ``torch.distributed``'s op functions that make the notes;
* ``groups``: process groups (id, desc, ranks) and their sequence numbers;
* ``recorder``: the daemon thread that writes notes and Flight Recorder entries as spans;
* ``flight_recorder``: the Flight Recorder's environment, its buffer, dumps on a stall;
* ``mesh``: ``ot.set_mesh`` and DeviceMesh detection; ``pipelining``: microbatch spans of pipeline stages;
* ``imports``: patching ``torch.distributed`` when it is imported after ``ot.init``.

``session.CommSession`` is what ``ot.init`` starts and ``ot.shutdown`` stops. Knows nothing of analysis.
"""

