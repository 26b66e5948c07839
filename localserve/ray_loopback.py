"""Ray's own `ray` command line, for a worker node that must stay on 127.0.0.1.

`ray start --address=127.0.0.1:<port>` swaps the loopback address for the
machine's interface address before it connects (Ray's
`resolve_ip_for_localhost`), and the switch that stops that on the head
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) makes `ray start` refuse to start a
worker node at all. In a pod the address is the head Service's name, which
Ray uses as given; this runs the unchanged CLI with the address used as given
too, so the worker finds its own address (127.0.0.1) from the head's, as a
pod does.

    python -m localserve.ray_loopback start --address=127.0.0.1:<port> ...
"""

from __future__ import annotations

import sys


def main() -> int:
    from ray._private import services
    from ray.scripts.scripts import main as ray_main

    def as_given(host: str) -> str:
        if not host:
            raise ValueError(f"Malformed host: {host}")
        return host

    services.resolve_ip_for_localhost = as_given
    result = ray_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
