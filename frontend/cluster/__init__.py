"""The processes behind the frontend: starting and watching them, the scheduler sockets, data-parallel replicas
and routing, and the nodes of a multi-node server."""
