"""The all-or-nothing merge of an adapter load answered by several members: the TP ranks behind one scheduler
(scheduler/adapter_table.py), and the data-parallel replicas behind the frontend (frontend/cluster/replica_set.py)."""

from __future__ import annotations

from loraplex.protocol.structs import AdapterOutcome


def merge_outcomes(
    lora_ids: list[int], answers: list[list[AdapterOutcome]], names: list[str]
) -> tuple[list[AdapterOutcome], dict[int, list[int]]]:
    """answers[m]: member m's outcomes in the order of lora_ids; names[m]: how a message names it ("rank 1: "; ""
    when its messages name it already). Per adapter, the first member's outcome if every member loaded it, else one
    failure: the members' shared message when all failed alike, else each failing member's, named, joined by "; ",
    with the first failing member's kind. And per member, the ids it loaded of adapters that failed elsewhere, which
    must be dropped there again."""
    outcomes: list[AdapterOutcome] = []
    rollback: dict[int, list[int]] = {}
    for i, lora_id in enumerate(lora_ids):
        column = [answer[i] for answer in answers]
        failed = [member for member, outcome in enumerate(column) if not outcome.success]
        if not failed:
            outcomes.append(column[0])
            continue
        messages = {column[member].error_message for member in failed}
        if len(failed) == len(column) and len(messages) == 1:
            message = messages.pop()  # every member says the same: no need to name them
        else:
            message = "; ".join(names[member] + column[member].error_message for member in failed)
        kind = column[failed[0]].error_kind
        outcomes.append(AdapterOutcome(lora_id=lora_id, success=False, error_message=message, error_kind=kind))
        for member, outcome in enumerate(column):
            if outcome.success:
                rollback.setdefault(member, []).append(lora_id)
    return outcomes, rollback
