"""A Ray cluster of this machine for pyop's tests: a head and one more node
(`ray.cluster_utils.Cluster`), each with two CPUs; the second also has one unit of the resource
`extra`, so an actor can be placed on it (and lost with it). Prints one JSON line (the head's address, the
nodes' ids and the session directory), then obeys lines on stdin: `remove` (the second node goes,
as a machine that fails), `add` (a new second node), `quit`. At `quit` or the end of stdin the
cluster stops."""

import json
import sys

from ray.cluster_utils import Cluster


def main():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    extra = cluster.add_node(num_cpus=2, resources={"extra": 1})
    cluster.wait_for_nodes()

    def say(**kw):
        print(json.dumps(kw), flush=True)

    say(
        address=cluster.address,
        nodes=[cluster.head_node.node_id, extra.node_id],
        session=cluster.head_node.get_session_dir_path(),
    )
    try:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "remove" and extra is not None:
                cluster.remove_node(extra, allow_graceful=False)
                extra = None
                say(removed=True)
            elif cmd == "add":
                extra = cluster.add_node(num_cpus=2, resources={"extra": 1})
                cluster.wait_for_nodes()
                say(added=extra.node_id)
            elif cmd == "quit":
                break
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
