"""A Ray cluster of this machine for pyop's tests: a head and one more node
(`ray.cluster_utils.Cluster`), each with two CPUs; the second also has one unit of the resource
`extra`, so an actor can be placed on it (and lost with it). Prints one JSON line (the head's address, the
nodes' ids, the session directory and a control socket's path), then obeys lines on stdin and on
the control socket (one line, one answer, for the tests that run in another process): `remove`
(the second node goes, as a machine that fails), `add` (a new second node), `quit` (stdin only).
At `quit` or the end of stdin the cluster stops."""

import json
import os
import queue
import socketserver
import sys
import tempfile
import threading

from ray.cluster_utils import Cluster


def main():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    extra = cluster.add_node(num_cpus=2, resources={"extra": 1})
    cluster.wait_for_nodes()

    # Ray's nodes are added and removed on the main thread (Ray sets signal handlers there):
    # commands from stdin and from the control socket queue up for it, each with where its
    # answer goes.
    commands = queue.Queue()

    def obey(cmd):
        """The answer to `cmd`, a JSON line; None for a command it does not know."""
        nonlocal extra
        if cmd == "remove" and extra is not None:
            cluster.remove_node(extra, allow_graceful=False)
            extra = None
            return json.dumps({"removed": True})
        if cmd == "add":
            extra = cluster.add_node(num_cpus=2, resources={"extra": 1})
            cluster.wait_for_nodes()
            return json.dumps({"added": extra.node_id})
        return None

    class Control(socketserver.StreamRequestHandler):
        def handle(self):
            cmd = self.rfile.readline().decode().strip()
            if cmd not in ("remove", "add"):
                # (`quit` is stdin's: the main loop would end without answering.)
                self.wfile.write(b"{}\n")
                return
            answer = queue.Queue()
            commands.put((cmd, answer.put))
            self.wfile.write(((answer.get() or "{}") + "\n").encode())

    def read_stdin():
        for line in sys.stdin:
            commands.put((line.strip(), lambda a: a is None or print(a, flush=True)))
        commands.put(("quit", None))

    folder = tempfile.mkdtemp(prefix="pyop-ray-")
    control = os.path.join(folder, "control")
    server = socketserver.ThreadingUnixStreamServer(control, Control)
    # A connection still waiting when the cluster stops does not hold its stop up.
    server.daemon_threads = True
    server.block_on_close = False
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def say(**kw):
        print(json.dumps(kw), flush=True)

    say(
        address=cluster.address,
        nodes=[cluster.head_node.node_id, extra.node_id],
        session=cluster.head_node.get_session_dir_path(),
        control=control,
    )
    threading.Thread(target=read_stdin, daemon=True).start()
    try:
        while True:
            cmd, reply = commands.get()
            if cmd == "quit":
                break
            reply(obey(cmd))
    finally:
        server.shutdown()
        server.server_close()
        os.unlink(control)
        os.rmdir(folder)
        cluster.shutdown()


if __name__ == "__main__":
    main()
