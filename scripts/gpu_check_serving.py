"""Groups G4 (1B decode perf + dynamic LoRA), G5 (server), G7 (TP=2 on one GPU) and G8 (compute-sanitizer)."""

from __future__ import annotations

from gpu_check_lib import Context


def g4_decode(ctx: Context) -> None:
    ctx.rec.skip("all", "todo")


def g5_server(ctx: Context) -> None:
    ctx.rec.skip("all", "todo")


def g7_tp2(ctx: Context) -> None:
    ctx.rec.skip("all", "todo")


def g8_sanitizer(ctx: Context) -> None:
    ctx.rec.skip("all", "todo")
