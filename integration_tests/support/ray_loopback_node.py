"""Test support: Ray's own ``ray start`` CLI for a second node on this machine, pinned to 127.0.0.1.

``python -m integration_tests.support.ray_loopback_node start --address=127.0.0.1:<port> ...`` is
``ray start ...`` with one switch moved. The cluster's processes run with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` so that Ray keeps every loopback address it is given (with
the default, ``resolve_ip_for_localhost`` swaps 127.0.0.1 for the machine's routable address,
in ``--node-ip-address`` and in ``--address`` alike); but with that switch Ray's CLI refuses a
worker node ("Multi-node Ray clusters are not supported on Windows and OSX"). Here, in this
process only, that refusal is lifted and loopback stays loopback; every process the node starts
(raylet, workers) inherits the switch from the environment.
"""

from __future__ import annotations

import sys

import ray._private.ray_constants as ray_constants
import ray._private.services as services
from ray.scripts.scripts import main

if __name__ == "__main__":
    ray_constants.ENABLE_RAY_CLUSTER = True  # ray start --address: allowed
    services.get_node_ip_address = lambda address=None: "127.0.0.1"  # what resolve_ip_for_localhost falls back to
    sys.argv = ["ray", *sys.argv[1:]]
    main()
