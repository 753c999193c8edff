"""The call core: one call's scheduling as a pure state machine (``CallCore.handle(stimulus) ->
Instructions``), split by concern: stimuli and instructions, buckets, liveness, latches,
session orders, settling, validation. No I/O, no asyncio (docs/call-core.md)."""
