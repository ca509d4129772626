"""The process's devices: what one process runs on, whatever the job around it.

A device kind (:class:`~.backend.DeviceKind`: :mod:`.cpu`, or :mod:`.cuda` imported only when
asked for) says how a stream's ops run, what a record and a wait enqueue, how bytes are copied
and how trace marks are read; :mod:`.streams` holds the streams and events, the same for
both; :mod:`.local` (and :mod:`.nccl_groups` among distinct GPUs) moves a collective's bytes
among this process's devices, matched by :mod:`.collectives`. :class:`~.backend.Backend`
composes a kind with its transports; a transport whose participants span processes
(:class:`~.backend.Transport`) is given to it by the job package (:mod:`overlap.backends.job`).

Nothing here imports the job package (``tests/test_layout.py`` holds it so).
"""
