"""The processes behind the frontend: starting and watching them, the scheduler sockets, data-parallel replicas
and routing, and the nodes of a multi-node server.

process_group.py     ProcessGroup: the scheduler and worker ranks of every replica as child processes, watched
scheduler_client.py  SchedulerClient: the frontend's end of one scheduler's sockets
replica_set.py       ReplicaSet: the data-parallel replicas (--dp-size), each behind its SchedulerClient
router.py            Router: which replica a request goes to (plain ints)
node_rendezvous.py   NodeRendezvous: how the nodes of a multi-node server find and watch each other
"""
