"""The parameter server: scheduler, CPU aggregation servers, wire protocol and PS client.

Run a role with ``python -m byteps_espresso.server`` (``DMLC_ROLE`` = scheduler or server);
workers use :class:`byteps_espresso.server.client.PSClient`. Modules:

    protocol   the binary wire format and its validation
    auth       message authentication with the job secret (MAC over header and frames)
    keys       key specifications and partitioning
    link       a node's registration and heartbeats with the scheduler
    faults     reports naming the process a job lost, for the launcher
    scheduler  rendezvous, key placement, barrier, liveness, shutdown, torch TCPStore
    server     per-key, per-round aggregation
    client     PSClient (declare, push_pull_async, barrier)
"""

__all__ = ["auth", "client", "faults", "keys", "link", "protocol", "scheduler", "server"]
