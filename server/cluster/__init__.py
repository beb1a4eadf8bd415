"""Where stage work runs: node agents that own sandboxes, tools and graders.

The scheduler hands INIT / RUN / EVAL of a job to a *node* (``server/cluster/node.py``); a job's
three stages stay on the node that holds its sandbox. Without ``--ray`` / ``--workers`` the only
node is the server process itself (:class:`~rollout.server.cluster.node.LocalNode`) and nothing
of Ray is imported; with them, ``server/cluster/ray_backend.py`` runs one Ray actor per node.
"""
