"""``moekit serve``: the simulator's web page on loopback."""

from __future__ import annotations

import argparse
import errno
import socket

from moekit.cli import COMMANDS
from moekit.cli._args import DefaultsHelpFormatter, UsageError, port_arg
from moekit.cli._model_source import add_source_arguments, simulated_source
from moekit.sim.budget import BUDGET_S


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help=COMMANDS["serve"],
        formatter_class=DefaultsHelpFormatter,
        description="Serve the interactive page of `moekit simulate` on http://HOST:PORT/ until Ctrl-C: every number "
        "on it comes from moekit.sim through /api/simulate. A run the cost model predicts above "
        f"{BUDGET_S} s of one CPU core is refused with a 400 naming the setting to lower.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback only by default)")
    p.add_argument("--port", type=port_arg, default=8765, help="port (0 picks a free one)")
    p.add_argument("--verbose", action="store_true", help="log every request")
    add_source_arguments(p, "a transformers config.json: every run routes with its layer's router (its E and "
                            "k) and prices that model's parameters and experts")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from moekit.sim.server import make_server

    source = simulated_source(args)  # a model whose every MoE layer hash-routes: refused
    model, name, fields = (None, "", None) if source is None else (source.layer, source.name, source.hf)
    try:
        server = make_server(args.host, args.port, args.verbose, model, name, fields)
    except OSError as err:
        raise UsageError(_bind_error(args.host, args.port, err)) from err
    host, port = server.server_address[:2]
    routing = f", routing as {name}" if name else ""
    print(f"moekit simulator on http://{host}:{port}/{routing}  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _bind_error(host: str, port: int, err: OSError) -> str:
    """Why the server could not listen, naming the flag to change."""
    if isinstance(err, socket.gaierror):
        return f"--host {host!r}: not an address of this machine ({err.strerror})"
    if err.errno == errno.EADDRINUSE:
        return f"--port {port}: already in use on {host} (another moekit serve?); choose another, or 0 for a free one"
    if err.errno == errno.EACCES:
        return f"--port {port}: permission denied on {host} (ports below 1024 need root); choose another, or 0"
    return f"--host {host!r} --port {port}: cannot listen there: {err.strerror or err}"
