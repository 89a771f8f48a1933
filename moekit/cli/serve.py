"""``moekit serve``: the simulator's web page on loopback."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the routing / load-balancing simulator page locally")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8765, help="port (0 picks a free one)")
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from moekit.sim.server import make_server

    server = make_server(args.host, args.port, args.verbose)
    host, port = server.server_address[:2]
    print(f"moekit simulator on http://{host}:{port}/  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
