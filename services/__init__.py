"""The services over :mod:`distill`: teacher, rollout workers, learner, jobs on Ray.

Importing the package turns gRPC's fork support off (``GRPC_ENABLE_FORK_SUPPORT=false``)
unless the operator set it, and it must run before ``grpc`` (or ``ray``, which imports it)
is first imported in the process: with gRPC channels or servers live, grpcio 1.81+ aborts a
forked child before its ``exec`` about one time in six (grpc/grpc#43055: the child's post-
fork handler restarts a poller on an epoll descriptor that ``subprocess``'s ``close_fds``
has closed). Ray starts its GCS, raylet and dashboard through ``Popen`` with a
``preexec_fn``, so a job or test process that had served gRPC lost its GCS that way ("Timed
out waiting for file .../gcs_server_port_..."). No process here uses gRPC in a forked child
that does not ``exec``, which is all that fork support is for. Ray's processes inherit the
setting from the process that starts Ray.
"""

import os

GRPC_FORK_SUPPORT_VARIABLE = "GRPC_ENABLE_FORK_SUPPORT"
os.environ.setdefault(GRPC_FORK_SUPPORT_VARIABLE, "false")
