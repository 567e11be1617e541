"""The scheduler process: queues, continuous batching, KV pages and adapter slots. It never imports torch.

Module map:
    page_allocator.py   PageAllocator: the free list of KV cache pages
    state_slots.py      StateSlotAllocator: the free list of a hybrid model's state slots (and of its state snapshots)
    prefix_cache.py     PrefixCache: full KV pages kept after their requests finish, found again by tokens and adapter
                        (a hybrid model's with the state snapshots a hit restores)
    slot_planner.py     SlotPlanner: which adapter sits in which device slot (holds, LRU eviction, pins)
    request.py          Request: one request's scheduler state
    ngram_proposer.py   speculative decoding's n-gram drafts from a request's own tokens (prompt lookup)
    image_runs.py       where a chunk may end when an image's placeholders attend both ways (never inside a run)
    batch_policy.py     BatchPolicy: which waiting requests join the next batch (limits, slots)
    admission_order.py  AdmissionOrder: the order waiting requests are offered in (priority, fair share), preemption
    fair_share.py       FairShare: virtual token counters (VTC), the fair order between clients
    adapter_table.py    AdapterTable: loaded adapter ids, and loads waiting on the ranks' reports
    scheduler.py        Scheduler: the state machine the process drives (no sockets)
    __main__.py / process.py  `python -m loraplex.scheduler`; SchedulerProcess: sockets, start-up handshake, main loop
"""
