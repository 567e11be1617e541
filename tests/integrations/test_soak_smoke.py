"""scripts/bench/soak.py stays runnable: a short soak with a request limit low enough that some requests get 429s; no
error, nothing left in flight. (Memory growth is judged only on long runs: a short one is all warm-up.)"""

from __future__ import annotations

from scripts.bench import soak


def test_a_short_soak_has_no_errors_and_leaves_nothing_behind() -> None:
    args = soak.parse_args(["--duration-s", "20", "--concurrency", "4", "--requests-per-minute", "30"])
    result = soak.soak(args)
    assert result["errors"] == []
    assert (result["requests_in_flight_after"], result["adapter_holds_after"]) == (0, 0)
    assert result["ok"] > 0 and result["rate_limited"] > 0 and result["adapter_cycles"] > 0
    assert "429 (expected)" in soak.report(result)
