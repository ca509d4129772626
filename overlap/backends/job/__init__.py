"""The multi-process job: what joins this process's devices to the other processes'.

The setup's collectives (:mod:`.bootstrap`), the one progress engine (:mod:`.engine`), the
point-to-point wires it progresses — host links (:mod:`.host_links`) and MPI (:mod:`.mpi`) —
and the collectives over them (:mod:`.wire`); NCCL across processes (:mod:`.nccl`,
:mod:`.nccl_bootstrap`); the control plane (:mod:`.distributed`, its messages in
:mod:`.control_messages`); and the guards of the process's exit (:mod:`.exit_guard`).

It builds on :mod:`overlap.backends.devices` (never the reverse); the runtime reaches it only
through :func:`overlap.backends.make_backend` and the names :mod:`overlap.backends` exports.
"""
